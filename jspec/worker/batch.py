"""What the scheduler asks a worker to launch: a prefill batch, a decode batch, or (DP attention)
one of either per rank. Each carries the requests' sampling and adapters beside its rows, so
a worker never reads a request."""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.config.sampling import SamplingParams
from jspec.worker.inputs import SeqChunk


@dataclasses.dataclass
class PrefillBatch:
    reqs: list = dataclasses.field(default_factory=list)  # the scheduler's requests, one per chunk
    chunks: list[SeqChunk] = dataclasses.field(default_factory=list)
    following: list[int | None] = dataclasses.field(default_factory=list)  # prompt token after each chunk; None
    # when the chunk ends the prompt
    slots: list[int] = dataclasses.field(default_factory=list)
    output_starts: list[int] = dataclasses.field(default_factory=list)  # each request's prompt length
    first_chunks: list[bool] = dataclasses.field(default_factory=list)  # chunk starts its request's prefill
    sampling: list[tuple[SamplingParams, int]] = dataclasses.field(default_factory=list)  # params and seed
    loras: list[int] = dataclasses.field(default_factory=list)  # LoRA pool slot (0: none)
    vocab_masks: np.ndarray | None = None  # [chunks, words] int32 token bitmasks; None: no grammar row
    # Per chunk: a running request's decode row (mixed prefill + decode): its one token is the
    # device carry's next token of its slot, which the host does not know yet.
    decode_rows: list[bool] = dataclasses.field(default_factory=list)

    @property
    def mixed(self) -> bool:
        return any(self.decode_rows)

    @property
    def with_prompt_logprobs(self) -> bool:
        """Some chunk scores prompt tokens (the prefill then computes logits at every token)."""
        return any(
            p.wants_prompt_logprobs and c.start < start
            for (p, _), c, start in zip(self.sampling, self.chunks, self.output_starts)
        )


@dataclasses.dataclass
class DecodeBatch:
    reqs: list = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    page_tables: list[list[int]] = dataclasses.field(default_factory=list)
    sampling: list[tuple[SamplingParams, int]] = dataclasses.field(default_factory=list)
    loras: list[int] = dataclasses.field(default_factory=list)
    shape: int = 0  # which of the worker's draft shapes runs (adaptive speculation picks it)
    drafting: list[bool] | None = None  # rows that verify their draft tree; None: all (others: the root alone)
    grammars: list | None = None  # each row's GrammarMatcher or None; None: no grammar row. The
    # worker defers the masks' computation (Worker.launch returns a PendingLaunch)


@dataclasses.dataclass
class DPBatch:
    """DP attention: one sub-batch per rank (None for an idle rank), all prefills or all decodes."""

    per_rank: list[PrefillBatch | DecodeBatch | None]

    @property
    def is_prefill(self) -> bool:
        return any(isinstance(b, PrefillBatch) for b in self.per_rank)

    @property
    def reqs(self) -> list:
        return [r for b in self.per_rank if b is not None for r in b.reqs]

"""Host-side request state."""

from __future__ import annotations

import dataclasses
import enum

from jspec.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or retracted and waiting to be prefilled again
    PREFILLING = "prefilling"  # holds a slot and pages; some prompt chunks still to run
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)  # identity semantics: queues hold and remove this exact request
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # token ids that end the request (EOS unless ignore_eos, plus stop_token_ids)
    arrival: int = 0  # admission order key
    output: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    matched_stop: int | str | None = None

    # KV bookkeeping
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    prefill_ids: list[int] = dataclasses.field(default_factory=list)  # what the (re-)prefill runs over
    prefilled: int = 0  # tokens of prefill_ids already in the KV
    kv_len: int = 0  # verified KV length as of the last processed step
    inflight: int = 0  # launched decodes that advance kv_len, outputs not processed yet
    inflight_outputs: int = 0  # launched steps (prefill or decode) whose outputs are not processed yet
    cached_prefix: object = None  # prefix-cache match this request holds locked

    # statistics
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not prefilled
    verify_ct: int = 0
    spec_emitted: int = 0
    retractions: int = 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def budget_left(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    def append(self, tokens) -> list[int]:
        """Appends tokens until a stop token or the budget; returns the tokens taken."""
        taken = []
        for t in tokens:
            t = int(t)
            taken.append(t)
            self.output.append(t)
            if t in self.stop_ids:
                self.finish("stop", matched=t)
                break
            if len(self.output) >= self.params.max_new_tokens:
                self.finish("length")
                break
        return taken

    def finish(self, reason: str, matched=None) -> None:
        if self.status is not Status.FINISHED:
            self.status = Status.FINISHED
            self.finish_reason = reason
            self.matched_stop = matched

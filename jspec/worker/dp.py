"""DP attention, the host side of the worker: one lockstep launch for every rank.

`DPWorker` wraps a one-rank worker (PlainWorker or SpecWorker built with the per-rank sizes
and no mesh) and borrows its step arguments and input builders. Each iteration is one
dispatch in which every rank runs its sub-batch, or an idle batch of padding rows when it
has none (jspec.distributed.dp_attention.RankStep). Each rank's pages and slots are its own
Scheduler's book, with local ids (jspec.scheduler.dp_scheduler).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec.config.sampling import SamplingParams
from jspec.distributed.dp_attention import RankStep, data_part, dp_param_specs, lift_state, place, rank_inputs
from jspec.distributed.mesh import DATA
from jspec.distributed.tensor_parallel import replicate
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.lora import LoraBatch
from jspec.layers.penalties import PrefillCounts, logit_bias_rows
from jspec.layers.sampling import SAMPLING_MODES, sampling_mode, sampling_rows
from jspec.worker.base import WorkerBase
from jspec.worker.batch import DPBatch, PrefillBatch
from jspec.worker.inputs import decode_inputs, decode_lora_slots, prefill_inputs, prefill_lora_slots, prefill_rows
from jspec.worker.spec import SpecWorker


class DPWorker:
    """DP attention's worker: a one-rank worker's programs run by every rank in one dispatch.
    Its sizes (pages, slots, prefill tokens) are per rank: each rank's Scheduler books its own."""

    def __init__(self, inner: WorkerBase, mesh):
        self.inner, self.mesh = inner, mesh
        self.dp = mesh.shape[DATA]
        self.page_size, self.num_pages, self.max_slots = inner.page_size, inner.num_pages, inner.max_slots
        self.kv_margin, self.max_emit = inner.kv_margin, inner.max_emit
        self.chunked_prefill_size = inner.chunked_prefill_size
        self.spec = isinstance(inner, SpecWorker)
        # lay_out_layers may have re-sliced the params: put each leaf back on exactly the spec the
        # shard_map's in_specs assume.
        inner.params = place(inner.params, mesh)
        shared = [jax.tree.map(data_part, dp_param_specs(inner.params))]
        if self.spec:
            # The draft is replicated: every rank drafts for its own requests.
            if inner.dparams is None:  # NGRAM: no draft weights
                shared.append(P())
            else:
                inner.dparams = replicate(inner.dparams, mesh)
                shared.append(jax.tree.map(lambda _: P(), inner.dparams))
        self._shared, self._steps = tuple(shared), (inner.prefill_step, inner.decode_step)
        self._lora = inner.lora
        self._build_steps()
        self.state = lift_state(inner.state, mesh)
        inner.state = None  # the one-rank copy; each rank now holds its own

    def _build_steps(self) -> None:
        shared, steps = self._shared, self._steps
        if self._lora is not None:
            # The pool is shared by the ranks like the params (each gets its "data" slice);
            # each rank's tokens name their adapter slots.
            shared = shared + (jax.tree.map(lambda x: data_part(x.sharding.spec), self._lora.weights),)
            steps = tuple(_with_lora(step, len(self._shared)) for step in steps)
        self._prefill = RankStep(steps[0], self.mesh, shared)
        self._decode = RankStep(steps[1], self.mesh, shared)

    # ---- what the engine and the server read ------------------------------------------------

    @property
    def lora(self):
        return self._lora

    def load_lora(self, adapter) -> int:
        return self.inner.load_lora(adapter)

    @property
    def params(self):
        return self.inner.params

    @params.setter
    def params(self, params) -> None:
        self.inner.params = params

    @property
    def top_n(self) -> int:
        return self.inner.top_n

    @property
    def dtype(self):
        return self.inner.dtype

    # The per-rank steps take no token bitmasks: the engine refuses grammars under DP attention.
    supports_grammar = False

    def grammar_programs_ready(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def wait_for_programs(self) -> None:
        pass  # DP steps compile at their first launch, never in the background

    # ---- launches -------------------------------------------------------------------------------

    def launch(self, batch: DPBatch) -> object:
        """One sub-batch or None per rank -> the PackedOutput of every rank, each leaf [dp, ...]."""
        subs = batch.per_rank
        if batch.is_prefill:
            T = max(
                self.inner.buckets.prefill_tokens(sum(len(c.tokens) for c in b.chunks))
                for b in subs
                if isinstance(b, PrefillBatch)
            )
            ranks = [self._prefill_inputs(b, T) if b is not None else self._idle_prefill_inputs(T) for b in subs]
            return self._launch_prefill(ranks, T, any(b is not None and b.with_prompt_logprobs for b in subs))
        B = max(self.inner.buckets.decode_bucket(len(b.slots)) for b in subs if b is not None)
        ranks = [self._decode_inputs(b, B) for b in subs]
        mode = sampling_mode(p for b in subs if b is not None for p, _ in b.sampling)
        return self._launch_decode(ranks, mode)

    def _prefill_inputs(self, b, T: int):
        inner = self.inner
        batch, mode, draft_tokens, finish_rows, slot_ids, counts = prefill_inputs(
            inner,
            b.chunks,
            b.following,
            b.slots,
            b.output_starts,
            b.first_chunks,
            min_tokens=T,
            logit_biases=[p.logit_bias for p, _ in b.sampling],
        )
        assert mode.max_q_len == T, (mode, T)
        rows = sampling_rows([p for p, _ in b.sampling], [s for _, s in b.sampling], slot_ids.shape[0])
        return (batch, draft_tokens, finish_rows, slot_ids, counts, rows, prefill_lora_slots(batch, b.chunks, b.loras))

    def _idle_prefill_inputs(self, T: int):
        """A rank with nothing to prefill: T padding tokens (their KV writes are dropped), no
        sequence, every row on the scratch slot; shapes as _prefill_inputs gives the others."""
        inner = self.inner
        B, M = prefill_rows(inner, T), inner.table_width
        scratch = inner.scratch_slot
        batch = ForwardBatch(
            np.zeros(T, np.int32),
            np.zeros(T, np.int32),
            np.full(T, inner.num_pages * inner.page_size, np.int32),
            np.zeros(B, np.int32),
            np.zeros((B, M), np.int32),
            np.zeros(B + 1, np.int32),
            np.zeros(B, np.int32),
        )
        counts = PrefillCounts(
            np.full(B, scratch, np.int32),
            np.full(T, scratch, np.int32),
            np.zeros(T, bool),
            *logit_bias_rows([], B, inner.vocab_size),
        )
        return (
            batch,
            np.zeros(T, np.int32),
            np.full(B, T, np.int32),
            np.full(B, scratch, np.int32),
            counts,
            sampling_rows([], [], B),
            np.zeros(T, np.int32),
        )

    def _decode_inputs(self, b, B: int):
        """One rank's decode arrays with B rows (an idle rank: B scratch rows)."""
        inner = self.inner
        slots = list(b.slots) if b is not None else []
        tables = list(b.page_tables) if b is not None else []
        sampling = b.sampling if b is not None else []
        pad = B - len(slots)
        slot_ids, pt, rows = decode_inputs(inner, slots + [inner.scratch_slot] * pad, tables + [[]] * pad, sampling)
        return slot_ids, pt, rows, decode_lora_slots(slot_ids.shape[0], b.loras if b is not None else [])

    def _launch_prefill(self, ranks, T: int, with_prompt_logprobs: bool):
        inner = self.inner
        mode = AttentionMode(False, T, inner.backend)
        batch, draft_tokens, finish_rows, slot_ids, counts, rows, loras = self._stack(ranks)
        tokens = inner.prefill_step_tokens(draft_tokens, finish_rows)
        self.state, out = self._prefill(
            *inner.step_weights(),
            *self._pool(),
            self.state,
            batch,
            *tokens,
            slot_ids,
            counts,
            rows,
            loras,
            **inner.step_statics(),
            mode=mode,
            top_n=inner.top_n,
            with_prompt_logprobs=with_prompt_logprobs,
        )
        return out

    def _stack(self, ranks: list[tuple]) -> tuple:
        """Per-rank input tuples (their last entry each token's adapter slot) -> [dp, ...]
        arrays split over "data"; the slots are None without a pool (the steps without LoRA)."""
        stacked = rank_inputs([r[:-1] for r in ranks], self.mesh)
        loras = rank_inputs([r[-1] for r in ranks], self.mesh) if self._lora is not None else None
        return (*stacked, loras)

    def _pool(self) -> tuple:
        return (self._lora.weights,) if self._lora is not None else ()

    def _launch_decode(self, ranks, mode: str):
        inner = self.inner
        slot_ids, pt, rows, loras = self._stack(ranks)
        self.state, out = self._decode(
            *inner.step_weights(),
            *self._pool(),
            self.state,
            slot_ids,
            pt,
            rows,
            loras,
            **inner.step_statics(),
            backend=inner.backend,
            top_n=inner.top_n,
            sampling=mode,
        )
        return out

    def warmup(self, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> int:
        """Every bucketed program, with every rank idle (the shapes the loop uses, whatever
        mix of busy and idle ranks it meets). Returns the programs run."""
        unknown = set(sampling_modes) - set(SAMPLING_MODES)
        if unknown:
            raise ValueError(f"unknown sampling modes {sorted(unknown)}; choose from {SAMPLING_MODES}")
        inner, n = self.inner, 0
        for T in inner.buckets.prefill_token_buckets():
            for with_prompt in (False, True) if prompt_logprobs else (False,):
                self._launch_prefill([self._idle_prefill_inputs(T)] * self.dp, T, with_prompt)
                n += 1
        for B in inner.buckets.decode_buckets():
            idle = (
                *decode_inputs(inner, [inner.scratch_slot] * B, [[0]] * B, [(SamplingParams(), 0)]),
                np.zeros(B, np.int32),
            )
            for mode in sampling_modes:
                self._launch_decode([idle] * self.dp, mode)
                n += 1
        jax.block_until_ready(jax.tree.leaves(self.state))
        return n


def _with_lora(step, n_shared: int):
    """A step taking (*shared, pool weights, state, ..., token slots) -> the one-rank step's
    (*shared, state, ..., LoraBatch) (LoRA is every step's last positional argument)."""

    def run(*args, **static):
        return step(*args[:n_shared], *args[n_shared + 1 : -1], LoraBatch(args[n_shared], args[-1]), **static)

    return run

"""DP attention, the host side of the worker: per-rank pages and slots, and one lockstep launch.

`DPWorker` wraps a one-rank worker (PlainWorker or SpecWorker built with the per-rank
sizes and no mesh): it borrows that worker's compiled-step arguments and input
builders, keeps dp `RankView`s (a page allocator and request slots each, with the
rank's own local ids, exactly what a one-device Scheduler expects), and launches
one dispatch per iteration in which every rank runs its sub-batch, or an idle batch
of padding rows when it has none (jspec.distributed.dp_attention.RankStep).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.kvcache.allocator import PageAllocator
from jspec.distributed.mesh import DATA
from jspec.distributed.dp_attention import RankStep, dp_param_specs, data_part, lift_state, place, rank_inputs
from jspec.distributed.tensor_parallel import replicate
from jspec.layers.penalties import PrefillCounts
from jspec.layers.sampling import SAMPLING_MODES, sampling_mode, sampling_rows
from jspec.config.sampling import SamplingParams
from jspec.layers.batch import bucket
from jspec.worker.spec import SpecWorker
from jspec.worker.base import WorkerBase, decode_lora_slots, prefill_lora_slots


class RankView:
    """What a one-rank Scheduler needs of a worker, for one DP rank: its own pages and slots."""

    def __init__(self, inner: WorkerBase, num_pages: int):
        self.page_size, self.kv_margin, self.max_emit = inner.page_size, inner.kv_margin, inner.max_emit
        self.allocator = PageAllocator(num_pages)
        self.max_slots = inner.max_slots
        self.free_slots = list(range(self.max_slots - 1, -1, -1))

    def prompt_logprob_programs_ready(self, chunked_prefill_size: int) -> bool:
        return True  # DP steps compile at their first launch

    alloc_slot = WorkerBase.alloc_slot
    free_slot = WorkerBase.free_slot
    check_no_leaks = WorkerBase.check_no_leaks


class AllRanksPool:
    """Pages of every rank together (for /metrics and /debug/state)."""

    def __init__(self, ranks: list[RankView]):
        self.ranks = ranks

    @property
    def num_usable(self) -> int:
        return sum(r.allocator.num_usable for r in self.ranks)

    @property
    def num_free(self) -> int:
        return sum(r.allocator.num_free for r in self.ranks)


class DPWorker:
    def __init__(self, inner: WorkerBase, mesh, chunked_prefill_size: int):
        self.inner, self.mesh = inner, mesh
        self.dp = mesh.shape[DATA]
        # As SGLang: the prefill budget is split over the ranks, since the MLP sees all ranks' tokens.
        self.chunked_prefill_size = max(8, chunked_prefill_size // self.dp)
        self.ranks = [RankView(inner, inner.allocator.num_pages) for _ in range(self.dp)]
        self.allocator = AllRanksPool(self.ranks)
        self.spec = isinstance(inner, SpecWorker)
        # unstack_layers re-sliced the params: put each leaf back on exactly the spec the
        # shard_map's in_specs assume.
        inner.params = place(inner.params, mesh)
        shared = [jax.tree.map(data_part, dp_param_specs(inner.params))]
        if self.spec:
            from jspec.speculative.method import spec_decode_step, spec_prefill_step

            # The draft is replicated: every rank drafts for its own requests.
            if inner.dparams is None:  # NGRAM: no draft weights
                shared.append(P())
            else:
                inner.dparams = replicate(inner.dparams, mesh)
                shared.append(jax.tree.map(lambda _: P(), inner.dparams))
            steps = spec_prefill_step, spec_decode_step
        else:
            from jspec.steps.plain import plain_decode_step, plain_prefill_step

            steps = plain_prefill_step, plain_decode_step
        self._shared, self._steps = tuple(shared), steps
        self._lora = None
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

    @lora.setter
    def lora(self, pool) -> None:
        """The engine's jspec.lora.pool.LoraPool (laid out on this mesh), or None."""
        self._lora = pool
        self._build_steps()

    @property
    def params(self):
        return self.inner.params

    @params.setter
    def params(self, params) -> None:
        self.inner.params = params

    @property
    def top_n(self) -> int:
        return self.inner.top_n

    @top_n.setter
    def top_n(self, n: int) -> None:
        self.inner.top_n = n

    @property
    def page_size(self) -> int:
        return self.inner.page_size

    @property
    def dtype(self):
        return self.inner.dtype

    @property
    def max_slots(self) -> int:
        return sum(r.max_slots for r in self.ranks)

    @property
    def free_slots(self) -> list[int]:
        return [s for r in self.ranks for s in r.free_slots]

    def check_no_leaks(self) -> None:
        for i, r in enumerate(self.ranks):
            try:
                r.check_no_leaks()
            except AssertionError as e:
                raise AssertionError(f"DP rank {i}: {e}") from None

    def wait_for_programs(self) -> None:
        pass  # DP steps compile at their first launch, never in the background

    # ---- launches -------------------------------------------------------------------------------

    def launch(self, batch) -> object:
        """batch: a jspec.scheduler.dp_scheduler.DPBatch (a sub-batch or None per rank) -> the
        StepOutput of every rank, each leaf [dp, ...]."""
        from jspec.scheduler.scheduler import PrefillBatch

        subs = batch.per_rank
        if batch.is_prefill:
            T = max(self.inner.prefill_tokens(sum(len(c.tokens) for c in b.chunks), self.chunked_prefill_size)
                    for b in subs if isinstance(b, PrefillBatch))
            ranks = [self._prefill_inputs(b, T) if b is not None else self._idle_prefill_inputs(T) for b in subs]
            return self._launch_prefill(ranks, T, any(b is not None and b.with_prompt_logprobs for b in subs))
        B = max(bucket(len(b.slots)) for b in subs if b is not None)
        ranks = [self._decode_inputs(b, B) for b in subs]
        mode = sampling_mode(r.params for b in subs if b is not None for r in b.reqs)
        return self._launch_decode(ranks, mode)

    def _prefill_inputs(self, b, T: int):
        inner = self.inner
        batch, mode, draft_tokens, finish_rows, slot_ids, counts = inner._prefill_inputs(
            b.chunks, b.following, b.slots, b.output_starts, b.first_chunks, min_tokens=T,
            chunked_prefill_size=self.chunked_prefill_size)
        assert mode.max_q_len == T, (mode, T)
        rows = sampling_rows([r.params for r in b.reqs], [r.seed for r in b.reqs], slot_ids.shape[0])
        return (batch, draft_tokens, finish_rows, slot_ids, counts, rows,
                prefill_lora_slots(batch, b.chunks, [r.lora_slot for r in b.reqs]))

    def _idle_prefill_inputs(self, T: int):
        """A rank with nothing to prefill: T padding tokens (their KV writes are dropped), no
        sequence, every row on the scratch slot; shapes as _prefill_inputs gives the others."""
        inner = self.inner
        B, M = bucket(1, inner.max_slots), inner.table_width
        scratch = inner.scratch_slot
        batch = ForwardBatch(np.zeros(T, np.int32), np.zeros(T, np.int32),
                             np.full(T, inner.allocator.num_pages * inner.page_size, np.int32),
                             np.zeros(B, np.int32), np.zeros((B, M), np.int32), np.zeros(B + 1, np.int32),
                             np.zeros(B, np.int32))
        counts = PrefillCounts(np.full(B, scratch, np.int32), np.full(T, scratch, np.int32), np.zeros(T, bool))
        return (batch, np.zeros(T, np.int32), np.full(B, T, np.int32), np.full(B, scratch, np.int32), counts,
                sampling_rows([], [], B), np.zeros(T, np.int32))

    def _decode_inputs(self, b, B: int):
        """One rank's decode arrays with B rows (an idle rank: B scratch rows)."""
        inner = self.inner
        slots = list(b.slots) if b is not None else []
        tables = list(b.page_tables) if b is not None else []
        reqs = b.reqs if b is not None else []
        pad = B - len(slots)
        slot_ids, pt, rows = inner._decode_inputs(slots + [inner.scratch_slot] * pad, tables + [[]] * pad,
                                                  [(r.params, r.seed) for r in reqs])
        return slot_ids, pt, rows, decode_lora_slots(slot_ids.shape[0], [r.lora_slot for r in reqs])

    def _launch_prefill(self, ranks, T: int, with_prompt_logprobs: bool):
        inner = self.inner
        mode = AttentionMode(False, T, inner.backend)
        batch, draft_tokens, finish_rows, slot_ids, counts, rows, loras = self._stack(ranks)
        if self.spec:
            self.state, out = self._prefill(
                inner.params, inner.dparams, *self._pool(), self.state, batch, draft_tokens, finish_rows, slot_ids,
                counts, rows, loras, cfg=inner.cfg, method=inner.method, mode=mode, top_n=inner.top_n,
                with_prompt_logprobs=with_prompt_logprobs)
        else:
            self.state, out = self._prefill(
                inner.params, *self._pool(), self.state, batch, draft_tokens, slot_ids, counts, rows, loras,
                cfg=inner.cfg, mode=mode, top_n=inner.top_n, with_prompt_logprobs=with_prompt_logprobs)
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
        if self.spec:
            self.state, out = self._decode(inner.params, inner.dparams, *self._pool(), self.state, slot_ids, pt, rows,
                                           loras, cfg=inner.cfg, method=inner.method, backend=inner.backend,
                                           top_n=inner.top_n, sampling=mode)
        else:
            self.state, out = self._decode(inner.params, *self._pool(), self.state, slot_ids, pt, rows, loras,
                                           cfg=inner.cfg, backend=inner.backend, top_n=inner.top_n, sampling=mode)
        return out

    def warmup(self, chunked_prefill_size: int, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> int:
        """Every bucketed program, with every rank idle (the shapes the loop uses, whatever
        mix of busy and idle ranks it meets). Returns the programs run."""
        unknown = set(sampling_modes) - set(SAMPLING_MODES)
        if unknown:
            raise ValueError(f"unknown sampling modes {sorted(unknown)}; choose from {SAMPLING_MODES}")
        inner, n = self.inner, 0
        for T in inner.prefill_token_buckets(self.chunked_prefill_size):
            for with_prompt in (False, True) if prompt_logprobs else (False,):
                self._launch_prefill([self._idle_prefill_inputs(T)] * self.dp, T, with_prompt)
                n += 1
        for B in inner.decode_buckets():
            idle = (*inner._decode_inputs([inner.scratch_slot] * B, [[0]] * B, [(SamplingParams(), 0)]),
                    np.zeros(B, np.int32))
            for mode in sampling_modes:
                self._launch_decode([idle] * self.dp, mode)
                n += 1
        jax.block_until_ready(jax.tree.leaves(self.state))
        return n


def _with_lora(step, n_shared: int):
    """A step taking (*shared, pool weights, state, ..., token slots) -> the one-rank step's
    (*shared, state, ..., LoraBatch) (LoRA is every step's last positional argument)."""
    from jspec.layers.lora import LoraBatch

    def run(*args, **static):
        return step(*args[:n_shared], *args[n_shared + 1 : -1], LoraBatch(args[n_shared], args[-1]), **static)

    return run

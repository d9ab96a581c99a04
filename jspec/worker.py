"""Workers: the host-side owners of params, device state and compiled steps.

Every worker offers the same interface to the scheduler, whatever the method:
- prefill(chunks, following, slots, sampling, output_starts, first_chunks, with_prompt_logprobs, loras)
  -> StepOutput of the first tokens (device), with the prompt tokens' logprobs if asked
- decode(slots, page_tables, sampling, loras) -> StepOutput (device)
(sampling: one (SamplingParams, seed) pair per chunk / slot; loras: the LoRA pool slot of
each chunk / slot, 0 = none, used when the worker has a pool in `lora`)
- kv_margin: KV positions past a request's verified length that one decode may write
- max_emit: most tokens one decode emits per request
plus request-slot and KV-page bookkeeping. The scheduler never knows which
method runs; device values only come back through the StepOutput it reads.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from jspec.config import ModelConfig
from jspec.paged_kv.allocator import PageAllocator
from jspec.paged_kv.pool import create_kv_pool, kv_bytes_per_page
from jspec.penalties import PrefillCounts, init_penalty_state
from jspec.scheduler.batch_builder import SeqChunk, bucket, build_forward_batch
from jspec.sampling import SAMPLING_MODES, SamplingRows, sampling_mode, sampling_rows
from jspec.sampling_params import SamplingParams
from jspec.steps import PlainState, init_plain_carry, plain_decode_step, plain_prefill_step

DEFAULT_KV_BYTES = 256 * 2**20


def default_attention_backend() -> str:
    """The Pallas kernels on the GPU; elsewhere the pure-jnp reference, because off the GPU
    Pallas runs interpreted (the tests' way to check the kernels), and an interpreted kernel
    copies its operands, the whole KV pool, on every call (SmolLM2-135M, 256 MiB of KV, 2 CPU
    cores: 0.7 tok/s against 28.9 with the reference)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def prefill_lora_slots(batch, chunks, loras) -> np.ndarray:
    """Each prefill token's adapter slot [T] (padding rows, or no loras: 0)."""
    ids = np.zeros(batch.tokens.shape[0], np.int32)
    for i, c in enumerate(chunks if loras is not None else ()):
        start = batch.query_start[i]
        ids[start : start + len(c.tokens)] = loras[i]
    return ids


def decode_lora_slots(B: int, loras) -> np.ndarray:
    """Each decode row's adapter slot [B] (padding rows, or no loras: 0)."""
    ids = np.zeros(B, np.int32)
    if loras is not None:
        ids[: len(loras)] = loras
    return ids


class WorkerBase:
    top_n = 0  # top logprobs each step returns (static: part of the compiled programs)
    lora = None  # a jspec.lora.LoraPool when the engine serves adapters (then every step takes it)

    def __init__(self, cfg: ModelConfig, params, *, page_size: int, num_pages: int, max_slots: int,
                 attention_backend: str | None, mesh=None):
        from jspec.models.llama import unstack_layers

        # Tensor parallel (jspec.parallel): params arrive sharded over mesh; steps run under it.
        self.mesh = mesh

        # Per-layer weight arrays: XLA would copy a weight sliced out of a stacked array.
        self.cfg, self.params = cfg, unstack_layers(params)
        self.dtype = params["embed"].dtype
        self.page_size = page_size
        self.allocator = PageAllocator(int(num_pages))
        self.max_slots = max_slots
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.backend = attention_backend or default_attention_backend()

    def _place(self, state):
        """Device state on the mesh: the target's KV pool split over KV heads, the rest
        (carry, penalties, the draft's state) replicated."""
        if self.mesh is None:
            return state
        from jax.sharding import NamedSharding

        from jspec.parallel.tensor_parallel import kv_pool_spec, replicate

        kv = NamedSharding(self.mesh, kv_pool_spec())
        rest = replicate(state._replace(target_kv=None), self.mesh)
        return rest._replace(target_kv=jax.tree.map(lambda x: jax.device_put(x, kv), state.target_kv))

    def decode(self, slots, page_tables, sampling, loras=None):
        """Builds the bucketed arrays, then launches (the subclass's decode_arrays)."""
        slot_ids, pt, rows = self._decode_inputs(slots, page_tables, sampling)
        return self.decode_arrays(slot_ids, pt, rows, sampling_mode(p for p, _ in sampling),
                                  self._decode_loras(slot_ids.shape[0], loras))

    def on_mesh(self):
        """Context for launching steps: the mesh, so attention runs per shard (shard_map)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @property
    def scratch_slot(self) -> int:
        return self.max_slots

    @property
    def max_pages_per_request(self) -> int:
        return -(-(self.cfg.max_position_embeddings + self.kv_margin + self.max_emit) // self.page_size)

    # Bucketed shapes, so warm-up can compile every program the loop will run:
    # prefill batches always have max_slots rows and full-context page tables
    # (only the token count T varies); decode batches vary in rows and page-table width.
    # The narrowest decode page table covers 128 tokens whatever the page size: counted in
    # pages, page size 1 would get 5 more widths (programs to compile) than page size 16.
    MIN_DECODE_TOKENS = 128

    @property
    def min_decode_pages(self) -> int:
        return max(1, self.MIN_DECODE_TOKENS // self.page_size)

    def prefill_token_buckets(self, chunked_prefill_size: int) -> list[int]:
        out, t = [], 8
        while t < chunked_prefill_size:
            out.append(t)
            t *= 2
        return out + [bucket(chunked_prefill_size, 8)]

    def decode_buckets(self) -> list[tuple[int, int]]:
        rows = [1 << i for i in range(bucket(self.max_slots).bit_length())]
        pages, m = [], self.min_decode_pages
        while m < self.max_pages_per_request:
            pages.append(m)
            m *= 2
        pages.append(bucket(self.max_pages_per_request, self.min_decode_pages))
        return [(b, m) for b in rows for m in pages]

    def warmup(self, chunked_prefill_size: int, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = True) -> int:
        """Runs every bucketed program once on scratch inputs (padding rows write only the
        scratch page and slot), so the serving loop never compiles. Returns programs run.
        A subset of sampling modes (or no prompt-logprob prefill) leaves the others to
        compile at their first use: each mode is its own set of decode programs."""
        unknown = set(sampling_modes) - set(SAMPLING_MODES)
        if unknown:
            raise ValueError(f"unknown sampling modes {sorted(unknown)}; choose from {SAMPLING_MODES}")
        greedy = (SamplingParams(), 0)
        n = 0
        for T in self.prefill_token_buckets(chunked_prefill_size):
            # One sequence of T tokens on the scratch page; `following` set, so no slot is touched.
            pages = [0] * (-(-T // self.page_size))
            for with_prompt in (False, True) if prompt_logprobs else (False,):
                self.prefill([SeqChunk([0] * T, 0, pages)], [0], [None], [greedy], with_prompt_logprobs=with_prompt)
                n += 1
        sampled = {"greedy": greedy, "temperature": (SamplingParams(temperature=1.0), 0),
                   "top_k": (SamplingParams(temperature=1.0, top_k=20), 0),
                   "filtered": (SamplingParams(temperature=1.0, top_p=0.9), 0)}
        for B, M in self.decode_buckets():
            for mode in sampling_modes:
                self.decode([self.scratch_slot] * B, [[0] * M] * B, [sampled[mode]] * B)
                n += 1
        jax.block_until_ready(jax.tree.leaves(self.state))
        return n

    def alloc_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.max_slots} request slots are in use")
        return self.free_slots.pop()

    def free_slot(self, slot: int) -> None:
        if slot in self.free_slots or not 0 <= slot < self.max_slots:
            raise ValueError(f"free of slot {slot}, which is not held")
        self.free_slots.append(slot)

    def check_no_leaks(self) -> None:
        self.allocator.check_no_leaks()
        if len(self.free_slots) != self.max_slots:
            raise AssertionError(f"request slot leak: {self.max_slots - len(self.free_slots)} slots held")

    def _prefill_inputs(self, chunks: list[SeqChunk], following: list[int | None], slots: list[int | None],
                        output_starts: list[int] | None, first_chunks: list[bool] | None, min_tokens: int = 8):
        """output_starts: per chunk, the position where its request's generated tokens begin
        (the prompt length; a re-prefill after retraction runs over both); first_chunks: the
        chunk is its request's first (its penalty counts start afresh). None: prompts only, all first.
        min_tokens: the smallest token bucket (DP attention gives every rank the largest rank's)."""
        batch, mode = build_forward_batch(chunks, page_size=self.page_size, num_pages=self.allocator.num_pages,
                                          min_tokens=min_tokens, min_seqs=self.max_slots,
                                          min_pages=self.max_pages_per_request, allow_decode_only=False)
        mode = mode._replace(backend=self.backend)
        T, B = batch.tokens.shape[0], batch.seq_lens.shape[0]
        draft_tokens = np.zeros(T, np.int32)  # the token after each row (draft inputs, prompt logprobs)
        finish_rows = np.full(B, T, np.int32)
        slot_ids = np.full(B, self.scratch_slot, np.int32)
        reset_slots = np.full(B, self.scratch_slot, np.int32)
        token_slots = np.full(T, self.scratch_slot, np.int32)
        is_output = np.zeros(T, bool)
        for i, c in enumerate(chunks):
            start, n = batch.query_start[i], len(c.tokens)
            slot = self.scratch_slot if slots[i] is None else slots[i]
            token_slots[start : start + n] = slot
            if output_starts is not None:
                is_output[start : start + n] = np.arange(c.start, c.start + n) >= output_starts[i]
            if first_chunks is None or first_chunks[i]:
                reset_slots[i] = slot
            draft_tokens[start : start + n - 1] = c.tokens[1:]
            if following[i] is None:
                finish_rows[i] = start + n - 1
                slot_ids[i] = slots[i]
            else:
                draft_tokens[start + n - 1] = following[i]
        return batch, mode, draft_tokens, finish_rows, slot_ids, PrefillCounts(reset_slots, token_slots, is_output)

    def _lora_batch(self, per_token: np.ndarray):
        """The step's LoRA argument: None without a pool, so those programs stay as they were."""
        if self.lora is None:
            return None
        from jspec.lora import LoraBatch

        return LoraBatch(self.lora.weights, per_token)

    def _prefill_loras(self, batch, chunks, loras):
        return self._lora_batch(prefill_lora_slots(batch, chunks, loras))

    def _decode_loras(self, B: int, loras):
        return self._lora_batch(decode_lora_slots(B, loras))

    def _decode_inputs(self, slots: list[int], page_tables: list[list[int]], sampling):
        B = bucket(len(slots))
        M = min(bucket(max(len(p) for p in page_tables), self.min_decode_pages),
                bucket(self.max_pages_per_request, self.min_decode_pages))
        slot_ids = np.full(B, self.scratch_slot, np.int32)
        slot_ids[: len(slots)] = slots
        pt = np.zeros((B, M), np.int32)
        for i, p in enumerate(page_tables):
            pt[i, : len(p)] = p
        return slot_ids, pt, _rows(sampling, B)


def _rows(sampling, n: int) -> SamplingRows:
    return sampling_rows([p for p, _ in sampling], [s for _, s in sampling], n)


class PlainWorker(WorkerBase):
    """No speculation: one token per request per decode."""

    kv_margin = 1
    max_emit = 1

    def __init__(self, cfg: ModelConfig, params, *, page_size: int = 16, num_pages: int | None = None,
                 max_slots: int = 64, kv_memory_bytes: int | None = None, attention_backend: str | None = None,
                 mesh=None):
        if num_pages is None:
            per_page = kv_bytes_per_page(cfg, page_size, params["embed"].dtype)
            num_pages = max(2, (kv_memory_bytes or DEFAULT_KV_BYTES) // per_page)
        super().__init__(cfg, params, page_size=page_size, num_pages=num_pages, max_slots=max_slots,
                         attention_backend=attention_backend, mesh=mesh)
        self.state = self._place(PlainState(create_kv_pool(cfg, int(num_pages), page_size, self.dtype),
                                            init_plain_carry(max_slots), init_penalty_state(max_slots, cfg.vocab_size)))

    def prefill(self, chunks, following, slots, sampling, output_starts=None, first_chunks=None,
                with_prompt_logprobs=False, loras=None):
        batch, mode, next_tokens, _, slot_ids, counts = self._prefill_inputs(chunks, following, slots, output_starts,
                                                                             first_chunks)
        rows = _rows(sampling, slot_ids.shape[0])
        lora = self._prefill_loras(batch, chunks, loras)
        with self.on_mesh():
            self.state, out = plain_prefill_step(self.params, self.state, batch, next_tokens, slot_ids, counts, rows,
                                                 lora, cfg=self.cfg, mode=mode, top_n=self.top_n,
                                                 with_prompt_logprobs=with_prompt_logprobs)
        return out

    def decode_arrays(self, slot_ids, page_tables, rows, mode: str, lora=None):
        """decode() on prebuilt (bucketed) arrays: the launch alone."""
        if lora is None and self.lora is not None:
            lora = self._decode_loras(slot_ids.shape[0], None)
        with self.on_mesh():
            self.state, out = plain_decode_step(self.params, self.state, slot_ids, page_tables, rows, lora, cfg=self.cfg,
                                                backend=self.backend, top_n=self.top_n, sampling=mode)
        return out


class SpecWorker(WorkerBase):
    """Speculative decoding with any SpecMethod (spec/methods.py builds it from a SpecConfig):
    the target pool, the method's draft state and the speculative carry."""

    def __init__(self, cfg: ModelConfig, params, method, dparams, *, page_size: int = 16,
                 num_pages: int | None = None, max_slots: int = 64, kv_memory_bytes: int | None = None,
                 attention_backend: str | None = None, mesh=None):
        from jspec.spec.method import init_spec_state

        if num_pages is None:
            dtype = params["embed"].dtype
            per_page = kv_bytes_per_page(cfg, page_size, dtype) + method.draft_kv_bytes_per_page(page_size, dtype)
            num_pages = max(2, (kv_memory_bytes or DEFAULT_KV_BYTES) // per_page)
        super().__init__(cfg, params, page_size=page_size, num_pages=num_pages, max_slots=max_slots,
                         attention_backend=attention_backend, mesh=mesh)
        from jspec.models.llama import unstack_layers

        self.method, self.spec = method, method.spec
        self.dparams = unstack_layers(dparams) if isinstance(dparams, dict) and "layers" in dparams else dparams
        if mesh is not None and self.dparams is not None:
            from jspec.parallel.tensor_parallel import replicate

            self.dparams = replicate(self.dparams, mesh)
        self.kv_margin = method.kv_margin
        self.max_emit = method.spec.num_steps + 1
        self.state = self._place(init_spec_state(
            method, create_kv_pool(cfg, int(num_pages), page_size, self.dtype), max_slots, int(num_pages),
            page_size, self.dtype, init_penalty_state(max_slots, cfg.vocab_size)))

    def prefill(self, chunks, following, slots, sampling, output_starts=None, first_chunks=None,
                with_prompt_logprobs=False, loras=None):
        from jspec.spec.method import spec_prefill_step

        batch, mode, draft_tokens, finish_rows, slot_ids, counts = self._prefill_inputs(
            chunks, following, slots, output_starts, first_chunks)
        rows = _rows(sampling, slot_ids.shape[0])
        lora = self._prefill_loras(batch, chunks, loras)
        with self.on_mesh():
            self.state, out = spec_prefill_step(
                self.params, self.dparams, self.state, batch, draft_tokens, finish_rows, slot_ids, counts, rows, lora,
                cfg=self.cfg, method=self.method, mode=mode, top_n=self.top_n, with_prompt_logprobs=with_prompt_logprobs,
            )
        return out

    def decode_arrays(self, slot_ids, page_tables, rows, mode: str, lora=None):
        """decode() on prebuilt (bucketed) arrays: the launch alone."""
        from jspec.spec.method import spec_decode_step

        if lora is None and self.lora is not None:
            lora = self._decode_loras(slot_ids.shape[0], None)
        with self.on_mesh():
            self.state, out = spec_decode_step(
                self.params, self.dparams, self.state, slot_ids, page_tables, rows, lora,
                cfg=self.cfg, method=self.method, backend=self.backend, top_n=self.top_n, sampling=mode,
            )
        return out

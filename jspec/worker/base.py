"""Workers: the host-side owners of params, device state and compiled step programs.

Every worker is a `Worker`: the scheduler hands it a batch to `launch` and reads back the
PackedOutput (steps.common.unpack_output), never knowing which method runs. The KV pool's
pages and the request slots are the scheduler's book (scheduler.kv_manager); the worker
only sizes the device arrays they index.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding

from jspec.config.engine import LAYER_LOOPS
from jspec.config.model import ModelConfig
from jspec.config.sampling import SamplingParams
from jspec.constrained.grammar import allow_all
from jspec.distributed.tensor_parallel import kv_pool_spec, replicate
from jspec.kvcache.pool import kv_cache_dtype as pool_dtype
from jspec.layers.batch import bucket
from jspec.layers.lora import LoraBatch
from jspec.layers.penalties import PrefillCounts
from jspec.layers.sampling import SAMPLING_MODES, SamplingRows, sampling_mode, sampling_rows
from jspec.models.common import unstack_layers
from jspec.worker.batch import DecodeBatch, PrefillBatch
from jspec.worker.inputs import SeqChunk, build_forward_batch
from jspec.worker.programs import Job, Program, ProgramMemory, Programs


def check_layer_loop(layer_loop: str) -> str:
    """The layer loop to run: "auto" is the scan, except on the GPU, where XLA copies each
    scanned layer's weights out of the stack before its matmuls (benchmarks/NOTES.md), which
    costs more device time than the scan saves in compilation."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"unknown layer_loop {layer_loop!r}; choose one of {LAYER_LOOPS}")
    if layer_loop == "auto":
        return "unrolled" if jax.default_backend() == "gpu" else "scan"
    return layer_loop


def lay_out_layers(params, layer_loop: str):
    """params with layers as the layer loop runs them: stacked for "scan" (one compiled layer
    body), per-layer arrays for "unrolled" (each layer compiled, no weight sliced out of a
    stack). A model that mixes dense and MoE layers has per-layer arrays either way."""
    if params is None or not isinstance(params, dict) or "layers" not in params:
        return params
    return unstack_layers(params) if layer_loop == "unrolled" else params


def default_attention_backend() -> str:
    """The Pallas kernels on the GPU; elsewhere the pure-jnp reference, because off the GPU
    Pallas runs interpreted (the tests' way to check the kernels), and an interpreted kernel
    copies its operands, the whole KV pool, on every call."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def prefill_token_buckets(chunked_prefill_size: int, smallest: int) -> list[int]:
    out, t = [], smallest
    while t < chunked_prefill_size:
        out.append(t)
        t *= 4
    return out + [max(bucket(chunked_prefill_size, 8), smallest)]


def carry_slots(query_start, chunks, slots, decode_rows, T: int) -> np.ndarray:
    """Each prefill token's source [T]: the slot whose carried next token it is (a decode row's
    one token), else -1 (the token the host gave)."""
    out = np.full(T, -1, np.int32)
    for i, row in enumerate(decode_rows or ()):
        if row:
            out[query_start[i]] = slots[i]
    return out


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


class Worker(Protocol):
    """What the scheduler and the engine use of a worker (WorkerBase, DPWorker)."""

    page_size: int
    num_pages: int  # KV pages of the pool (per DP rank), page 0 the scratch page
    max_slots: int  # request slots (per DP rank); slot max_slots is scratch
    kv_margin: int  # KV positions past a request's verified length that one decode may write
    max_emit: int  # most tokens one decode emits per request
    chunked_prefill_size: int  # most prompt tokens one prefill runs
    top_n: int  # top logprobs every step returns
    vocab_size: int  # columns of the logits (token bitmasks cover them)
    supports_grammar: bool  # its steps take token bitmasks (structured outputs)

    def launch(self, batch) -> object:
        """Dispatches one step over the batch; returns its device outputs (a PackedOutput), or a
        PendingLaunch for a decode with grammar rows (the engine finishes it)."""

    def warmup(self, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> int: ...

    def prompt_logprob_programs_ready(self) -> bool: ...

    def grammar_programs_ready(self) -> bool: ...

    def wait_for_programs(self) -> None: ...


class WorkerBase:
    """params, the device state and the step programs of one model; PlainWorker and SpecWorker
    add the state and the steps of their method."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        *,
        page_size: int,
        num_pages: int,
        max_slots: int,
        chunked_prefill_size: int,
        top_n: int = 0,
        attention_backend: str | None = None,
        mesh=None,
        layer_loop: str = "auto",
        lora=None,
        kv_cache_dtype: str = "auto",
        decode_paddings: tuple[int, ...] | None = None,
    ):
        # Tensor parallel (jspec.distributed): params arrive sharded over mesh; steps run under it.
        self.mesh = mesh
        self.layer_loop = check_layer_loop(layer_loop)
        self.cfg, self.params = cfg, lay_out_layers(params, self.layer_loop)
        self.dtype = params["embed"].dtype
        self.kv_dtype = pool_dtype(kv_cache_dtype, self.dtype)  # the target's pool (a draft's keeps self.dtype)
        self.top_n = top_n  # top logprobs every step returns (static: part of the compiled programs)
        # A jspec.lora.pool.LoraPool when the engine serves adapters: every step then takes it, and
        # the projections' weights carry its A columns.
        self.lora = lora
        if lora is not None:
            self.params = lora.extend_params(self.params)
        self.page_size = page_size
        self.num_pages = int(num_pages)
        self.max_slots = max_slots
        self.decode_paddings = decode_paddings
        self.chunked_prefill_size = chunked_prefill_size
        self.backend = attention_backend or default_attention_backend()
        self.programs = Programs(mesh)
        self._program_specs: dict = {}
        self._last_decode: DecodeInputs | None = None
        self.warmed_up = False  # warm-up ran: programs a request needs first compile in the background
        self._grammar_keys: list | None = None

    def init_state(self, num_pages: int, max_slots: int):
        """The method's device state for a pool of num_pages and max_slots request slots."""
        raise NotImplementedError

    def resize(self, num_pages: int, max_slots: int) -> None:
        """A new device state of num_pages and max_slots (the old one is dropped first, so both
        never coexist); the programs compile again for its shapes."""
        self.state = None
        self.num_pages, self.max_slots = int(num_pages), max_slots
        self.programs.clear()
        self._program_specs.clear()
        self._last_decode = None
        self.state = self._place(self.init_state(self.num_pages, max_slots))

    def first_step(self) -> None:
        """Runs the largest greedy decode once over scratch rows (they write only the scratch page
        and slot): what the first step over a new pool costs is paid at start-up."""
        B = self.decode_buckets()[-1]
        jax.block_until_ready(self.decode([self.scratch_slot] * B, [[0]] * B, [(SamplingParams(), 0)] * B))
        self._last_decode = None

    def measure_programs(self) -> dict[str, ProgramMemory]:
        """Compiles the largest prefill and the largest decode (both sampling programs) for the
        current state and returns their device memory by label: what sizing reserves for the
        programs beside the weights and the pool."""
        scratch = {"greedy": (SamplingParams(), 0), "sampled": (SamplingParams(temperature=1.0), 0)}
        B, T = self.decode_buckets()[-1], self.prefill_token_buckets()[-1]
        collecting, self.programs.collecting = self.programs.collecting, []
        try:
            pages = [0] * (-(-T // self.page_size))
            self.prefill([SeqChunk([0] * T, 0, pages)], [0], [None], [scratch["greedy"]])
            for mode in SAMPLING_MODES:
                self.decode([self.scratch_slot] * B, [[0]] * B, [scratch[mode]] * B)
            jobs = self.programs.collecting
        finally:
            self.programs.collecting = collecting
            self._last_decode = None
        self.programs.compile_all(jobs)
        return {j.program.label: self.programs.memory(j.program.key) for j in jobs}

    def _place(self, state):
        """Device state on the mesh: the target's KV pool split over KV heads, the rest
        (carry, penalties, the draft's state) replicated."""
        if self.mesh is None:
            return state

        kv = NamedSharding(self.mesh, kv_pool_spec())
        rest = replicate(state._replace(target_kv=None), self.mesh)
        return rest._replace(target_kv=jax.tree.map(lambda x: jax.device_put(x, kv), state.target_kv))

    def launch(self, batch: PrefillBatch | DecodeBatch):
        loras = batch.loras if self.lora is not None else None
        if isinstance(batch, PrefillBatch):
            return self.prefill(
                batch.chunks,
                batch.following,
                batch.slots,
                batch.sampling,
                batch.output_starts,
                batch.first_chunks,
                batch.with_prompt_logprobs,
                loras,
                batch.vocab_masks,
                batch.decode_rows if batch.mixed else None,
            )
        return self.decode(
            batch.slots, batch.page_tables, batch.sampling, loras, batch.shape, batch.drafting, batch.grammars
        )

    # Whether the steps take token bitmasks (structured outputs); a worker without them refuses
    # a batch that has one.
    supports_grammar = False
    # Whether its prefill step takes decode rows, their tokens read from the device carry (a
    # mixed prefill + decode batch); its prefill programs then take carry_slots [T].
    mixes_decode_rows = False
    # The engine's designated read: a speculative decode with grammar rows reads the proposed
    # tree through it.
    host_read: Callable | None = None

    def decode_masked(
        self, slot_ids, page_tables, rows, mode: str, lora, grammars, shape: int = 0
    ) -> PendingLaunch | None:
        """A decode with grammar rows: the part that needs no mask is dispatched now, the rest
        waits in the PendingLaunch for the engine to have processed the previous step (the
        masks follow from its tokens). Warm-up (collecting programs) records both, returns None."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def _device_masks(self, masks):
        return masks if self.mesh is not None else jax.device_put(masks)

    def _vocab_mask(self, masks, rows: int):
        """The step's bitmask argument: masks [n, words] padded with allow-all rows to `rows`;
        None stays None (the unmasked program)."""
        if masks is None:
            return None
        if not self.supports_grammar:
            raise ValueError(f"{type(self).__name__} does not run structured outputs (token bitmasks)")

        full = allow_all(rows, self.vocab_size)
        full[: len(masks)] = masks
        return full if self.mesh is not None else jax.device_put(full)

    def decode(self, slots, page_tables, sampling, loras=None, shape: int = 0, drafting=None, grammars=None):
        """Builds the bucketed arrays, then launches (the subclass's decode_arrays). A batch the
        same as the last one (the common case: the same requests, no new page) reuses the last
        arrays, already on the device, so the launch only dispatches."""
        last = self._last_decode
        if drafting is not None and all(drafting):
            drafting = None
        if last is None or not last.same_batch(slots, page_tables, sampling, loras, drafting):
            slot_ids, pt, rows = self._decode_inputs(slots, page_tables, sampling)
            ids = decode_lora_slots(slot_ids.shape[0], loras) if self.lora is not None else None
            flags = None
            if drafting is not None:  # padding rows verify their root alone
                flags = np.zeros(slot_ids.shape[0], bool)
                flags[: len(drafting)] = drafting
            arrays = (slot_ids, pt, rows, ids, flags)
            last = self._last_decode = DecodeInputs(
                list(slots),
                [list(p) for p in page_tables],
                list(sampling),
                None if loras is None else list(loras),
                arrays if self.mesh is not None else jax.device_put(arrays),
                sampling_mode(p for p, _ in sampling),
                None if drafting is None else list(drafting),
            )
        slot_ids, pt, rows, ids, flags = last.arrays
        lora = self._lora_batch(ids) if ids is not None else None
        if grammars is not None:
            if not self.supports_grammar:
                raise ValueError(f"{type(self).__name__} does not run structured outputs (token bitmasks)")
            if lora is None and self.lora is not None:
                lora = self._decode_loras(slot_ids.shape[0], None)
            padded = list(grammars) + [None] * (slot_ids.shape[0] - len(grammars))
            return self.decode_masked(slot_ids, pt, rows, last.mode, lora, padded, shape)
        drafting_rows = None if last.drafting is None else sum(last.drafting)
        return self.decode_arrays(slot_ids, pt, rows, last.mode, lora, shape, flags, drafting_rows)

    # What a method's worker gives: its step functions, the weights they take before the state,
    # their static arguments, and which prefill outputs they read.
    prefill_step: Callable
    decode_step: Callable

    def step_weights(self) -> tuple:
        return (self.params,)

    def step_statics(self, shape: int = 0) -> dict:
        """Static arguments of the steps; shape: which draft shape (speculative workers)."""
        return dict(cfg=self.cfg)

    num_shapes = 1  # draft shapes a decode can run (an adaptive speculative worker has several)

    def prefill_step_tokens(self, next_tokens, finish_rows) -> tuple:
        return (next_tokens,)

    def prefill(
        self,
        chunks,
        following,
        slots,
        sampling,
        output_starts=None,
        first_chunks=None,
        with_prompt_logprobs=False,
        loras=None,
        vocab_masks=None,
        decode_rows=None,
    ):
        """decode_rows: per chunk, a running request's decode row (mixes_decode_rows workers)."""
        if decode_rows is not None and not self.mixes_decode_rows:
            raise ValueError(f"{type(self).__name__} does not mix decode rows into a prefill")
        batch, mode, next_tokens, finish_rows, slot_ids, counts = self._prefill_inputs(
            chunks, following, slots, output_starts, first_chunks, decode_rows=decode_rows
        )
        rows = _rows(sampling, slot_ids.shape[0])
        lora = self._prefill_loras(batch, chunks, loras)
        T = batch.tokens.shape[0]
        statics = dict(self.step_statics(), mode=mode, top_n=self.top_n, with_prompt_logprobs=with_prompt_logprobs)
        label = f"prefill T={T}{' prompt logprobs' if with_prompt_logprobs else ''}"
        tokens = self.prefill_step_tokens(next_tokens, finish_rows)
        mask = self._vocab_mask(vocab_masks, slot_ids.shape[0])
        masked = () if mask is None else ("masked",)
        args = (*self.step_weights(), self.state, batch, *tokens, slot_ids, counts, rows, lora)
        if self.mixes_decode_rows:
            args += (mask, carry_slots(batch.query_start, chunks, slots, decode_rows, T))
        elif mask is not None:
            args += (mask,)
        return self._launch(
            self._prefill_key(T, with_prompt_logprobs) + masked,
            lambda: (self.prefill_step, statics, label + " masked" * bool(masked)),
            args,
        )

    def decode_arrays(
        self,
        slot_ids,
        page_tables,
        rows,
        mode: str,
        lora=None,
        shape: int = 0,
        drafting=None,
        drafting_rows: int | None = None,
    ):
        """decode() on prebuilt (bucketed) arrays: the launch alone. drafting [B] (speculative
        workers): the rows that verify their tree, drafting_rows of them; None: every row."""
        if lora is None and self.lora is not None:
            lora = self._decode_loras(slot_ids.shape[0], None)
        B = slot_ids.shape[0]
        statics = dict(self.step_statics(shape), backend=self.backend, top_n=self.top_n, sampling=mode)
        label = f"decode B={B} {mode}" + (f" shape {shape}" if shape else "")
        args = (*self.step_weights(), self.state, slot_ids, page_tables, rows, lora)
        tokens = None
        if drafting is not None:
            tokens = statics["verify_tokens"] = self.verify_tokens(B, shape, drafting_rows)
            label += f" {tokens} verify tokens"
            args += (drafting,)
        return self._launch(self._decode_key(B, mode, shape, tokens), lambda: (self.decode_step, statics, label), args)

    def verify_tokens(self, B: int, shape: int, drafting_rows: int) -> int:
        """The ragged verify's token count: the drafting rows rounded up to a power of two."""
        raise ValueError("only a speculative worker lets rows opt out of drafting")

    def _decode_key(self, B: int, mode: str, shape: int, verify_tokens: int | None = None) -> tuple:
        return ("decode", B, mode, self.top_n, shape, verify_tokens)

    def decode_ready(self, rows: int, mode: str, shape: int, drafting_rows: int | None = None) -> bool:
        """Whether the decode program for this many rows, sampling program, shape and (with rows
        opted out of drafting) drafting rows is compiled; if not, starts compiling it in the
        background (the loop runs another program meanwhile)."""
        B = self.decode_bucket(rows)
        tokens = None if drafting_rows is None else self.verify_tokens(B, shape, drafting_rows)
        key = self._decode_key(B, mode, shape, tokens)
        if self.programs.ready(key):
            return True
        if self.programs.pending(key):
            return False
        scratch = (SamplingParams(temperature=1.0) if mode == "sampled" else SamplingParams(), 0)
        drafting = None if drafting_rows is None else [i < drafting_rows for i in range(B)]
        collecting, self.programs.collecting = self.programs.collecting, []
        try:
            self.decode([self.scratch_slot] * B, [[0]] * B, [scratch] * B, shape=shape, drafting=drafting)
            jobs = self.programs.collecting
        finally:
            self.programs.collecting = collecting
            self._last_decode = None  # the scratch batch is not the loop's
        for job in jobs:
            self.programs.compile_in_background(job)
        return False

    def on_mesh(self):
        """Context for launching steps: the mesh, so attention runs per shard (shard_map)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _launch(self, key, describe, args: tuple):
        """Runs a step program over the donated state; returns its PackedOutput (None while
        warm-up only collects the programs). describe() -> (step, static arguments, label) is
        called on a key's first launch only."""
        program = self._program_specs.get(key)
        if program is None:
            program = self._program_specs[key] = Program(key, *describe())
        result = self.programs.run(program, args)
        if result is None:
            return None
        self.state, out = result
        return out

    @property
    def scratch_slot(self) -> int:
        return self.max_slots

    @property
    def max_pages_per_request(self) -> int:
        return -(-(self.cfg.max_position_embeddings + self.kv_margin + self.max_emit) // self.page_size)

    @property
    def table_width(self) -> int:
        """Columns of every page table a step gets: the most pages a request can hold. One
        width for all, so it is no dimension of the programs; the kernels read a sequence's
        pages only."""
        return bucket(self.max_pages_per_request)

    # Bucketed shapes, so warm-up can compile every program the loop will run: prefill batches
    # always have max_slots rows and vary in tokens T; decode batches vary in rows B.
    MIN_PREFILL_TOKENS = 16

    def prefill_token_buckets(self) -> list[int]:
        """Token counts a prefill pads to: powers of four up to the chunk size (coarse, so
        there are few programs; a prefill is one read of the weights whatever its T)."""
        return prefill_token_buckets(self.chunked_prefill_size, self.MIN_PREFILL_TOKENS)

    def prefill_tokens(self, total: int) -> int:
        """The bucket a prefill of `total` tokens pads to."""
        for t in self.prefill_token_buckets():
            if total <= t:
                return t
        return bucket(total)

    def decode_buckets(self) -> list[int]:
        """Row counts a decode pads to: the powers of two up to max_slots', or with paddings
        given those (clipped to it) and every power of two past the largest."""
        top = bucket(self.max_slots)
        every = [1 << i for i in range(top.bit_length())]
        if not self.decode_paddings:
            return every
        chosen = {min(b, top) for b in self.decode_paddings}
        return [b for b in every if b in chosen or b > max(chosen)]

    def decode_bucket(self, rows: int) -> int:
        """The bucket a decode of this many rows pads to."""
        return next((b for b in self.decode_buckets() if b >= rows), bucket(rows))

    def warmup(self, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> int:
        """Compiles every bucketed program the loop runs (without running them), so the serving
        loop never compiles. Returns the number of programs. Prompt-logprob prefills are left
        out unless asked for: they compile in the background when a request first needs them;
        so do the masked programs of structured outputs (grammar_programs_ready)."""
        self.warmed_up = True
        return self.programs.compile_all(self.warmup_jobs(sampling_modes, prompt_logprobs))

    def grammar_programs_ready(self) -> bool:
        """Whether the programs that take token bitmasks are compiled; if not, starts compiling
        them in the background (requests without a grammar go on meanwhile). A worker that did
        not warm up compiles each at its first use instead, as all its programs."""
        if not self.warmed_up:
            return True
        if self._grammar_keys is None:
            jobs = self.grammar_jobs()
            self._grammar_keys = [j.program.key for j in jobs]
        else:
            jobs = None
        if all(self.programs.ready(k) for k in self._grammar_keys):
            return True
        if not self.programs.compiling():
            for job in jobs if jobs is not None else self.grammar_jobs():
                self.programs.compile_in_background(job)
        return False

    def grammar_jobs(self) -> list[Job]:
        """The masked programs of every decode bucket and sampling program, and of every prefill
        token bucket (recorded, not run)."""
        collecting, self.programs.collecting = self.programs.collecting, []
        try:
            scratch = {"greedy": (SamplingParams(), 0), "sampled": (SamplingParams(temperature=1.0), 0)}
            for B in self.decode_buckets():
                for mode in SAMPLING_MODES:
                    self.decode([self.scratch_slot] * B, [[0]] * B, [scratch[mode]] * B, grammars=[None] * B)
            for T in self.prefill_token_buckets():
                pages = [0] * (-(-T // self.page_size))
                chunk = SeqChunk([0] * T, 0, pages)
                self.prefill([chunk], [0], [None], [scratch["greedy"]], vocab_masks=allow_all(1, self.vocab_size))
            return self.programs.collecting
        finally:
            self.programs.collecting = collecting

    def warmup_jobs(self, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> list[Job]:
        """The programs warm-up compiles: every launch shape, built on scratch inputs (padding
        rows write only the scratch page and slot) and recorded, not run."""
        unknown = set(sampling_modes) - set(SAMPLING_MODES)
        if unknown:
            raise ValueError(f"unknown sampling modes {sorted(unknown)}; choose from {SAMPLING_MODES}")
        jobs = []
        for with_prompt in (False, True) if prompt_logprobs else (False,):
            jobs += self.prefill_jobs(with_prompt)
        return jobs + self.decode_jobs(sampling_modes, shapes=(0,))

    def decode_jobs(self, sampling_modes, shapes) -> list[Job]:
        """The decode programs of every row bucket for these sampling programs and draft shapes
        (recorded, not run). Warm-up takes the configured shape's; an adaptive engine the others'."""
        scratch = {"greedy": (SamplingParams(), 0), "sampled": (SamplingParams(temperature=1.0), 0)}
        collecting, self.programs.collecting = self.programs.collecting, []
        try:
            for shape in shapes:
                for B in self.decode_buckets():
                    for mode in sampling_modes:
                        self.decode([self.scratch_slot] * B, [[0]] * B, [scratch[mode]] * B, shape=shape)
            return self.programs.collecting
        finally:
            self.programs.collecting = collecting
            self._last_decode = None

    def prefill_jobs(self, with_prompt_logprobs: bool) -> list[Job]:
        """The prefill programs of every token bucket (recorded, not run)."""
        collecting, self.programs.collecting = self.programs.collecting, []
        try:
            for T in self.prefill_token_buckets():
                # One sequence of T tokens on the scratch page; `following` set, so no slot is touched.
                pages = [0] * (-(-T // self.page_size))
                self.prefill(
                    [SeqChunk([0] * T, 0, pages)],
                    [0],
                    [None],
                    [(SamplingParams(), 0)],
                    with_prompt_logprobs=with_prompt_logprobs,
                )
            return self.programs.collecting
        finally:
            self.programs.collecting = collecting

    def wait_for_programs(self) -> None:
        """Blocks until the programs compiling in the background are ready."""
        self.programs.wait_pending()

    def prompt_logprob_programs_ready(self) -> bool:
        """Whether the prefills that score prompt tokens are compiled; if not, starts compiling
        them in the background (the loop goes on with requests that do not need them)."""
        keys = [self._prefill_key(T, True) for T in self.prefill_token_buckets()]
        if all(self.programs.ready(k) for k in keys):
            return True
        if not self.programs.compiling():
            for job in self.prefill_jobs(True):
                self.programs.compile_in_background(job)
        return False

    def _prefill_key(self, T: int, with_prompt_logprobs: bool) -> tuple:
        return ("prefill", T, with_prompt_logprobs, self.top_n)

    def _prefill_inputs(
        self,
        chunks: list[SeqChunk],
        following: list[int | None],
        slots: list[int | None],
        output_starts: list[int] | None,
        first_chunks: list[bool] | None,
        min_tokens: int = 8,
        decode_rows: list[bool] | None = None,
    ):
        """output_starts: per chunk, the position where its request's generated tokens begin
        (the prompt length; a re-prefill after retraction runs over both); first_chunks: the
        chunk is its request's first (its penalty counts start afresh). None: prompts only, all first.
        decode_rows: the chunk is a running request's decode row, whose token its penalty counts
        already hold (counted when it was sampled).
        min_tokens: the smallest token bucket (DP attention gives every rank the largest rank's)."""
        T = self.prefill_tokens(max(sum(len(c.tokens) for c in chunks), min_tokens))
        batch, mode = build_forward_batch(
            chunks,
            page_size=self.page_size,
            num_pages=self.num_pages,
            min_seqs=self.max_slots,
            min_pages=self.table_width,
            allow_decode_only=False,
            num_tokens=T,
        )
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
            if not (decode_rows and decode_rows[i]):
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

    def load_lora(self, adapter) -> int:
        """Writes a read adapter into a free slot of the pool (and its A columns into the
        weights): no recompilation, the shapes never change. Returns its slot."""
        slot, self.params = self.lora.load(adapter, self.params)
        return slot

    def _lora_batch(self, per_token: np.ndarray):
        """The step's LoRA argument: None without a pool, so those programs stay as they were."""
        if self.lora is None:
            return None

        return LoraBatch(self.lora.weights, per_token)

    def _prefill_loras(self, batch, chunks, loras):
        return self._lora_batch(prefill_lora_slots(batch, chunks, loras))

    def _decode_loras(self, B: int, loras):
        return self._lora_batch(decode_lora_slots(B, loras))

    def _decode_inputs(self, slots: list[int], page_tables: list[list[int]], sampling):
        B, M = self.decode_bucket(len(slots)), self.table_width
        slot_ids = np.full(B, self.scratch_slot, np.int32)
        slot_ids[: len(slots)] = slots
        pt = np.zeros((B, M), np.int32)
        for i, p in enumerate(page_tables):
            pt[i, : len(p)] = p
        return slot_ids, pt, _rows(sampling, B)


@dataclasses.dataclass
class PendingLaunch:
    """The second half of a decode with grammar rows: finish() computes the masks from the
    grammars' state (the engine calls it once the previous step's tokens are processed),
    dispatches the rest of the step and returns its outputs (a PackedOutput)."""

    finish: Callable[[], object]


@dataclasses.dataclass
class DecodeInputs:
    """The last decode batch: what the scheduler asked for, and the arrays built for it."""

    slots: list[int]
    page_tables: list[list[int]]
    sampling: list[tuple[SamplingParams, int]]
    loras: list[int] | None
    arrays: tuple  # slot_ids, page tables, SamplingRows, adapter slots, drafting flags (None: unused)
    mode: str
    drafting: list[bool] | None = None

    def same_batch(self, slots, page_tables, sampling, loras, drafting=None) -> bool:
        # A request keeps its SamplingParams object, and list equality tries identity first.
        return (
            slots == self.slots
            and page_tables == self.page_tables
            and sampling == self.sampling
            and loras == self.loras
            and drafting == self.drafting
        )


def _rows(sampling, n: int) -> SamplingRows:
    return sampling_rows([p for p, _ in sampling], [s for _, s in sampling], n)

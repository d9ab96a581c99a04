"""Workers: the host-side owners of params, device state and compiled step programs.

Every worker is a `Worker`: the scheduler hands it a batch to `launch` and reads back the
PackedOutput (steps.common.unpack_output), never knowing which method runs. The KV pool's
pages and the request slots are the scheduler's book (scheduler.kv_manager); the worker
only sizes the device arrays they index. `WorkerBase` is the launch path: a batch's arrays
(worker/inputs.py), then its program (worker/programs.py plans and compiles them).
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
from jspec.distributed.tensor_parallel import kv_pool_spec, replicate
from jspec.kvcache.pool import kv_cache_dtype as pool_dtype
from jspec.layers.batch import bucket
from jspec.layers.sampling import SAMPLING_MODES, sampling_mode
from jspec.models.common import UnrolledStack, unstack_layers
from jspec.worker import programs as plan
from jspec.worker.batch import DecodeBatch, PrefillBatch
from jspec.worker.inputs import (
    DecodeInputs,
    carry_slots,
    decode_inputs,
    decode_lora_slots,
    lora_batch,
    padded_vocab_masks,
    prefill_inputs,
    prefill_lora_slots,
    rows_of,
)
from jspec.worker.programs import Buckets, Program, Programs, decode_key, prefill_key


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
    stack), an UnrolledStack for "unrolled_stack". A model that mixes dense and MoE layers has per-layer arrays either way."""
    if params is None or not isinstance(params, dict) or "layers" not in params:
        return params
    if layer_loop == "unrolled":
        return unstack_layers(params)
    if (
        layer_loop == "unrolled_stack"
        and isinstance(params["layers"], dict)
        and not isinstance(params["layers"], UnrolledStack)
    ):
        return {**params, "layers": UnrolledStack(params["layers"])}
    return params


def default_attention_backend() -> str:
    """The Pallas kernels on the GPU; elsewhere the pure-jnp reference, because off the GPU
    Pallas runs interpreted (the tests' way to check the kernels), and an interpreted kernel
    copies its operands, the whole KV pool, on every call."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def place_state(state, mesh):
    """Device state on the mesh: the target's KV pool split over KV heads, the rest (carry,
    penalties, the draft's state) replicated."""
    if mesh is None:
        return state
    kv = NamedSharding(mesh, kv_pool_spec())
    rest = replicate(state._replace(target_kv=None), mesh)
    return rest._replace(target_kv=jax.tree.map(lambda x: jax.device_put(x, kv), state.target_kv))


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
        self.vocab_size = cfg.vocab_size  # columns of the logits (token bitmasks cover them)
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
        self.chunked_prefill_size = chunked_prefill_size
        self.buckets = Buckets(chunked_prefill_size, max_slots, decode_paddings)
        self.backend = attention_backend or default_attention_backend()
        self.programs = Programs(mesh)
        self._program_specs: dict = {}
        self.last_decode: DecodeInputs | None = None  # reused by a decode of the same batch
        self.warmed_up = False  # warm-up ran: programs a request needs first compile in the background
        # The prefill programs by sampling program. On the GPU the sampled program runs the top-k /
        # top-p search over every row (a branch on the data would cost a host round trip there), so
        # all-greedy prefills get a program without it, as decodes do; elsewhere the one sampled
        # program skips the search inside when no row asks for it.
        self.prefill_sampling_modes = SAMPLING_MODES if jax.default_backend() == "gpu" else ("sampled",)
        self.grammar_keys: list | None = None  # the programs that take token bitmasks, once planned

    def init_state(self, num_pages: int, max_slots: int):
        """The method's device state for a pool of num_pages and max_slots request slots."""
        raise NotImplementedError

    def resize(self, num_pages: int, max_slots: int) -> None:
        """A new device state of num_pages and max_slots (the old one is dropped first, so both
        never coexist); the programs compile again for its shapes."""
        self.state = None
        self.num_pages, self.max_slots = int(num_pages), max_slots
        self.buckets = dataclasses.replace(self.buckets, max_slots=max_slots)
        self.programs.clear()
        self._program_specs.clear()
        self.last_decode = None
        self.state = place_state(self.init_state(self.num_pages, max_slots), self.mesh)

    # ---- the Worker protocol: what the scheduler and the engine call ---------------------------

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

    def warmup(self, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> int:
        return plan.warm_up(self, sampling_modes, prompt_logprobs)

    def prompt_logprob_programs_ready(self) -> bool:
        return plan.prompt_logprob_programs_ready(self)

    def grammar_programs_ready(self) -> bool:
        return plan.grammar_programs_ready(self)

    def wait_for_programs(self) -> None:
        """Blocks until the programs compiling in the background are ready."""
        self.programs.wait_pending()

    def load_lora(self, adapter) -> int:
        """Writes a read adapter into a free slot of the pool (and its A columns into the
        weights): no recompilation, the shapes never change. Returns its slot."""
        slot, self.params = self.lora.load(adapter, self.params)
        return slot

    # Whether the steps take token bitmasks (structured outputs); a worker without them refuses
    # a batch that has one.
    supports_grammar = False
    # Whether its prefill step takes decode rows, their tokens read from the device carry (a
    # mixed prefill + decode batch); its prefill programs then take carry_slots [T].
    mixes_decode_rows = False
    # The engine's designated read: a speculative decode with grammar rows reads the proposed
    # tree through it.
    host_read: Callable | None = None

    # ---- what a method's worker gives: its step functions, the weights they take before the
    # state, their static arguments, and which prefill outputs they read -------------------------

    prefill_step: Callable
    decode_step: Callable
    num_shapes = 1  # draft shapes a decode can run (an adaptive speculative worker has several)

    def step_weights(self) -> tuple:
        return (self.params,)

    def step_statics(self, shape: int = 0) -> dict:
        """Static arguments of the steps; shape: which draft shape (speculative workers)."""
        return dict(cfg=self.cfg)

    def prefill_step_tokens(self, next_tokens, finish_rows) -> tuple:
        return (next_tokens,)

    def verify_tokens(self, B: int, shape: int, drafting_rows: int) -> int:
        """The ragged verify's token count: the drafting rows rounded up to a power of two."""
        raise ValueError("only a speculative worker lets rows opt out of drafting")

    def decode_masked(
        self, slot_ids, page_tables, rows, mode: str, lora, grammars, shape: int = 0
    ) -> PendingLaunch | None:
        """A decode with grammar rows: the part that needs no mask is dispatched now, the rest
        waits in the PendingLaunch for the engine to have processed the previous step (the
        masks follow from its tokens). Warm-up (collecting programs) records both, returns None."""
        raise NotImplementedError

    # ---- launches ----------------------------------------------------------------------------

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
        batch, mode, next_tokens, finish_rows, slot_ids, counts = prefill_inputs(
            self,
            chunks,
            following,
            slots,
            output_starts,
            first_chunks,
            decode_rows=decode_rows,
            logit_biases=[p.logit_bias for p, _ in sampling],
        )
        rows = rows_of(sampling, slot_ids.shape[0])
        lora = lora_batch(self.lora, prefill_lora_slots(batch, chunks, loras))
        T = batch.tokens.shape[0]
        sampled = self.prefill_program(sampling_mode(p for p, _ in sampling))
        statics = dict(
            self.step_statics(),
            mode=mode,
            top_n=self.top_n,
            with_prompt_logprobs=with_prompt_logprobs,
            sampling=sampled,
        )
        label = f"prefill T={T}{' greedy' if sampled == 'greedy' else ''}{' prompt logprobs' if with_prompt_logprobs else ''}"
        tokens = self.prefill_step_tokens(next_tokens, finish_rows)
        mask = self._vocab_mask(vocab_masks, slot_ids.shape[0])
        masked = () if mask is None else ("masked",)
        args = (*self.step_weights(), self.state, batch, *tokens, slot_ids, counts, rows, lora)
        if self.mixes_decode_rows:
            args += (mask, carry_slots(batch.query_start, chunks, slots, decode_rows, T))
        elif mask is not None:
            args += (mask,)
        return self._launch(
            prefill_key(T, with_prompt_logprobs, self.top_n, sampled) + masked,
            lambda: (self.prefill_step, statics, label + " masked" * bool(masked)),
            args,
        )

    def prefill_program(self, mode: str) -> str:
        """The sampling program a prefill of this sampling mode runs (prefill_sampling_modes)."""
        return mode if mode in self.prefill_sampling_modes else "sampled"

    def decode(self, slots, page_tables, sampling, loras=None, shape: int = 0, drafting=None, grammars=None):
        """Builds the bucketed arrays, then launches (decode_arrays). A batch the same as the
        last one (the common case: the same requests, no new page) reuses the last arrays,
        already on the device, so the launch only dispatches."""
        last = self.last_decode
        if drafting is not None and all(drafting):
            drafting = None
        if last is None or not last.same_batch(slots, page_tables, sampling, loras, drafting):
            slot_ids, pt, rows = decode_inputs(self, slots, page_tables, sampling)
            ids = decode_lora_slots(slot_ids.shape[0], loras) if self.lora is not None else None
            flags = None
            if drafting is not None:  # padding rows verify their root alone
                flags = np.zeros(slot_ids.shape[0], bool)
                flags[: len(drafting)] = drafting
            last = self.last_decode = DecodeInputs(
                list(slots),
                [list(p) for p in page_tables],
                list(sampling),
                None if loras is None else list(loras),
                self._on_device((slot_ids, pt, rows, ids, flags)),
                sampling_mode(p for p, _ in sampling),
                None if drafting is None else list(drafting),
            )
        slot_ids, pt, rows, ids, flags = last.arrays
        lora = lora_batch(self.lora, ids) if ids is not None else None
        if grammars is not None:
            if not self.supports_grammar:
                raise ValueError(f"{type(self).__name__} does not run structured outputs (token bitmasks)")
            if lora is None and self.lora is not None:
                lora = lora_batch(self.lora, decode_lora_slots(slot_ids.shape[0], None))
            padded = list(grammars) + [None] * (slot_ids.shape[0] - len(grammars))
            return self.decode_masked(slot_ids, pt, rows, last.mode, lora, padded, shape)
        drafting_rows = None if last.drafting is None else sum(last.drafting)
        return self.decode_arrays(slot_ids, pt, rows, last.mode, lora, shape, flags, drafting_rows)

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
            lora = lora_batch(self.lora, decode_lora_slots(slot_ids.shape[0], None))
        B = slot_ids.shape[0]
        statics = dict(self.step_statics(shape), backend=self.backend, top_n=self.top_n, sampling=mode)
        label = f"decode B={B} {mode}" + (f" shape {shape}" if shape else "")
        args = (*self.step_weights(), self.state, slot_ids, page_tables, rows, lora)
        tokens = None
        if drafting is not None:
            tokens = statics["verify_tokens"] = self.verify_tokens(B, shape, drafting_rows)
            label += f" {tokens} verify tokens"
            args += (drafting,)
        key = decode_key(B, mode, self.top_n, shape, tokens)
        return self._launch(key, lambda: (self.decode_step, statics, label), args)

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

    def _vocab_mask(self, masks, rows: int):
        """The step's bitmask argument: masks [n, words] padded with allow-all rows to `rows`;
        None stays None (the unmasked program)."""
        if masks is None:
            return None
        if not self.supports_grammar:
            raise ValueError(f"{type(self).__name__} does not run structured outputs (token bitmasks)")
        return self._on_device(padded_vocab_masks(masks, rows, self.vocab_size))

    def _on_device(self, arrays):
        """Host arrays put on the device ahead of the launch; under a mesh the step places them."""
        return arrays if self.mesh is not None else jax.device_put(arrays)

    def on_mesh(self):
        """Context for launching steps: the mesh, so attention runs per shard (shard_map)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    # ---- geometry ----------------------------------------------------------------------------

    @property
    def scratch_slot(self) -> int:
        return self.max_slots

    @property
    def table_width(self) -> int:
        """Columns of every page table a step gets: the most pages a request can hold. One
        width for all, so it is no dimension of the programs; the kernels read a sequence's
        pages only."""
        most_positions = self.cfg.max_position_embeddings + self.kv_margin + self.max_emit
        return bucket(-(-most_positions // self.page_size))


@dataclasses.dataclass
class PendingLaunch:
    """The second half of a decode with grammar rows: finish() computes the masks from the
    grammars' state (the engine calls it once the previous step's tokens are processed),
    dispatches the rest of the step and returns its outputs (a PackedOutput)."""

    finish: Callable[[], object]

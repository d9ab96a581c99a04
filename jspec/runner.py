"""ModelRunner: params, the paged KV pool and the compiled forward+sample step.

The step is `kv, tokens = step(params, kv, batch, temperature, key)` with the
pool donated, so KV writes happen in place on the device. One compiled
program exists per (bucketed shape, AttentionMode); `compiled_programs`
counts them so tests can check that bucketing keeps the number small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.models.batch import AttentionMode, ForwardBatch
from jspec.models.llama import forward
from jspec.paged_kv.allocator import PageAllocator
from jspec.paged_kv.pool import KVPool, create_kv_pool, kv_bytes_per_page
from jspec.sampling import sample_tokens
from jspec.scheduler.batch_builder import SeqChunk, build_forward_batch


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "unroll_layers"), donate_argnames=("kv",))
def forward_sample_step(params, kv: KVPool, batch: ForwardBatch, temperature, key, *, cfg, mode, unroll_layers=False):
    kv, out = forward(params, cfg, kv, batch, mode, unroll_layers=unroll_layers)
    return kv, sample_tokens(out.logits, temperature, key)


def default_attention_backend() -> str:
    return "pallas"


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        params,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_memory_bytes: int | None = None,
        attention_backend: str | None = None,
    ):
        self.cfg = cfg
        self.params = params
        self.dtype = params["embed"].dtype
        self.page_size = page_size
        if num_pages is None:
            per_page = kv_bytes_per_page(cfg, page_size, self.dtype)
            budget = kv_memory_bytes if kv_memory_bytes is not None else 256 * 2**20
            num_pages = max(2, budget // per_page)
        self.allocator = PageAllocator(int(num_pages))
        self.kv = create_kv_pool(cfg, int(num_pages), page_size, self.dtype)
        self.backend = attention_backend or default_attention_backend()
        self._programs: set = set()

    @property
    def compiled_programs(self) -> int:
        return len(self._programs)

    def step(self, chunks: list[SeqChunk], temperature: np.ndarray, key: jax.Array) -> jax.Array:
        """Runs one forward over the chunks and samples one token per chunk (device array [B])."""
        batch, mode = build_forward_batch(chunks, page_size=self.page_size, num_pages=self.kv.num_pages)
        mode = mode._replace(backend=self.backend)
        temps = np.zeros(batch.seq_lens.shape[0], np.float32)
        temps[: len(chunks)] = temperature
        self._programs.add((batch.tokens.shape, batch.page_tables.shape, mode))
        self.kv, tokens = forward_sample_step(
            self.params, self.kv, batch, jnp.asarray(temps), key, cfg=self.cfg, mode=mode
        )
        return tokens


class SpecRunner:
    """Target + draft params, both KV pools and the speculative carry, with the EAGLE steps.

    Request slots index the carry; the host hands out slots and pages and
    builds page tables, the device owns sequence lengths.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        dcfg,
        dparams,
        spec,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        max_slots: int = 64,
        kv_memory_bytes: int | None = None,
        attention_backend: str | None = None,
    ):
        from jspec.models.eagle import layer_config
        from jspec.spec.eagle import SpecState, init_carry

        self.cfg, self.params, self.dcfg, self.dparams, self.spec = cfg, params, dcfg, dparams, spec
        self.dtype = params["embed"].dtype
        self.page_size = page_size
        dlayer = layer_config(dcfg)
        if num_pages is None:
            per_page = kv_bytes_per_page(cfg, page_size, self.dtype) + kv_bytes_per_page(dlayer, page_size, self.dtype)
            budget = kv_memory_bytes if kv_memory_bytes is not None else 256 * 2**20
            num_pages = max(2, budget // per_page)
        self.allocator = PageAllocator(int(num_pages))
        self.max_slots = max_slots
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.state = SpecState(
            create_kv_pool(cfg, int(num_pages), page_size, self.dtype),
            create_kv_pool(dlayer, int(num_pages), page_size, self.dtype),
            init_carry(max_slots, spec.eagle_topk, dcfg.hidden_size, self.dtype),
        )
        self.backend = attention_backend or default_attention_backend()

    @property
    def scratch_slot(self) -> int:
        return self.max_slots

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

    def prefill(self, chunks: list[SeqChunk], following: list[int | None], slots: list[int | None]) -> jax.Array:
        """Prefills chunks on target and draft. following[i]: the prompt token after chunk i, or None
        when chunk i ends its prompt (then slots[i] receives the carry). Returns first tokens [B]."""
        from jspec.spec.eagle import spec_prefill_step

        batch, mode = build_forward_batch(chunks, page_size=self.page_size, num_pages=self.allocator.num_pages)
        mode = mode._replace(backend=self.backend)
        T, B = batch.tokens.shape[0], batch.seq_lens.shape[0]
        draft_tokens = np.zeros(T, np.int32)
        finish_rows = np.full(B, T, np.int32)
        slot_ids = np.full(B, self.scratch_slot, np.int32)
        for i, c in enumerate(chunks):
            start = batch.query_start[i]
            n = len(c.tokens)
            draft_tokens[start : start + n - 1] = c.tokens[1:]
            if following[i] is None:
                finish_rows[i] = start + n - 1
                slot_ids[i] = slots[i]
            else:
                draft_tokens[start + n - 1] = following[i]
        self.state, first = spec_prefill_step(
            self.params, self.dparams, self.state, batch, draft_tokens, finish_rows, slot_ids,
            cfg=self.cfg, dcfg=self.dcfg, spec=self.spec, mode=mode,
        )
        return first

    def decode(self, slots: list[int], page_tables: list[list[int]]):
        """One speculative iteration over the given slots; returns SpecStepOutput (device arrays)."""
        from jspec.scheduler.batch_builder import bucket
        from jspec.spec.eagle import spec_decode_step

        B = bucket(len(slots))
        M = bucket(max(len(p) for p in page_tables))
        slot_ids = np.full(B, self.scratch_slot, np.int32)
        slot_ids[: len(slots)] = slots
        pt = np.zeros((B, M), np.int32)
        for i, p in enumerate(page_tables):
            pt[i, : len(p)] = p
        self.state, out = spec_decode_step(
            self.params, self.dparams, self.state, slot_ids, pt,
            cfg=self.cfg, dcfg=self.dcfg, spec=self.spec, backend=self.backend,
        )
        return out

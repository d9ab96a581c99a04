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

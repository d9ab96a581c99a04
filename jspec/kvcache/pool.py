"""Device KV pool: two large arrays, K and V, of shape [layers, pages, page_size, kv_heads, head_dim].

A model with latent attention (DeepSeek's MLA) keeps one latent per token in K
([layers, pages, page_size, 1, kv_lora_rank + qk_rope_head_dim], its values are part of it)
and an empty V (last dim 0), so the pool keeps its two leaves and every page operation
(moves, transfers) applies unchanged.

All layers live in one array per K/V so a step's state has two KV leaves, not
2 x layers (dispatch cost grows with the number of leaves). The pool is only
ever updated inside jitted steps that donate it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.kernels.paged_tiles import FP8_KV, FP8_KV_BYTES


class KVPool(NamedTuple):
    k: jax.Array  # [L, P, S, Hkv, D]
    v: jax.Array

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


def check_page_size(page_size: int) -> None:
    # Kernel tiles must be powers of two, so a page must be too.
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 1, got {page_size}")


# --kv-cache-dtype (SGLang's values) -> the pool's dtype; "auto" is the model's. An FP8 pool
# stores its e4m3 values as bytes (kernels/paged_tiles.py says why).
KV_CACHE_DTYPES = {"fp8_e4m3": FP8_KV_BYTES}


def kv_cache_dtype(setting: str, model_dtype):
    if setting == "auto":
        return jnp.dtype(model_dtype)
    if setting not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {setting!r}; choose auto or one of {sorted(KV_CACHE_DTYPES)}")
    return jnp.dtype(KV_CACHE_DTYPES[setting])


def is_fp8_cache(cache: jax.Array) -> bool:
    return jnp.dtype(cache.dtype) == FP8_KV_BYTES


def kv_token_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of one token's K and of its V in the pool."""
    if cfg.deepseek is not None:
        return (1, cfg.deepseek.latent_dim), (1, 0)
    return (cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    per_token = sum(h * d for h, d in kv_token_shapes(cfg))
    return cfg.num_layers * page_size * per_token * jnp.dtype(dtype).itemsize


def create_kv_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype, num_layers: int | None = None) -> KVPool:
    check_page_size(page_size)
    lead = (cfg.num_layers if num_layers is None else num_layers, num_pages, page_size)
    k, v = kv_token_shapes(cfg)
    return KVPool(jnp.zeros(lead + k, dtype), jnp.zeros(lead + v, dtype))


def write_kv(cache: jax.Array, layer: jax.Array, slots: jax.Array, new: jax.Array) -> jax.Array:
    """Writes new[t] at flat slot slots[t] (= page * page_size + offset) of one layer.

    Slots out of range (the padding convention: slot = pages * page_size) are
    dropped, so padded tokens write nothing.
    """
    S = cache.shape[2]
    if is_fp8_cache(cache):
        # Saturate: e4m3fn has no infinity, and a value past its largest would become NaN.
        limit = float(jnp.finfo(FP8_KV).max)
        new = jnp.clip(new.astype(jnp.float32), -limit, limit).astype(FP8_KV)
        new = jax.lax.bitcast_convert_type(new, FP8_KV_BYTES)
    return cache.at[layer, slots // S, slots % S].set(new.astype(cache.dtype), mode="drop")

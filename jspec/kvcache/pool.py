"""Device KV pool: two large arrays, K and V, of shape [layers, pages, page_size, kv_heads, head_dim].

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


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    return 2 * cfg.num_layers * page_size * cfg.kv_size * jnp.dtype(dtype).itemsize


def create_kv_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype) -> KVPool:
    check_page_size(page_size)
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


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

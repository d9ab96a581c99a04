"""Paged attention for the model: picks the decode or extend kernel (or its reference)."""

from __future__ import annotations

import jax

from jspec.models.batch import AttentionMode, ForwardBatch

BACKENDS = ("pallas", "reference")


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    batch: ForwardBatch,
    mode: AttentionMode,
    *,
    sm_scale: float,
    mask: jax.Array | None = None,
) -> jax.Array:
    if mode.backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {mode.backend!r}; choose one of {BACKENDS}")
    if mode.backend == "pallas":
        from jspec.pallas.paged_decode import paged_decode as decode
        from jspec.pallas.paged_extend import paged_extend as extend
    else:
        from jspec.pallas.ref import paged_decode_ref as decode
        from jspec.pallas.ref import paged_extend_ref as extend
    if mode.decode_only and mask is None:
        return decode(q, k_cache, v_cache, layer, batch.seq_lens, batch.page_tables, sm_scale=sm_scale)
    return extend(
        q,
        k_cache,
        v_cache,
        layer,
        batch.seq_lens,
        batch.page_tables,
        batch.query_start,
        sm_scale=sm_scale,
        max_q_len=mode.max_q_len,
        mask=mask,
    )

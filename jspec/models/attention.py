"""Paged attention for the model: picks the decode or extend kernel (or its reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def paged_decode_with_lse(q, k_cache, v_cache, layer, seq_lens, page_tables, *, sm_scale: float, backend: str):
    """Decode attention that also returns the log-sum-exp of each row's logits: (out [B, Hq, D] f32,
    lse [B, Hq] f32, -inf where nothing is visible), so that attention over the paged prefix can
    be merged with attention over keys that live outside the pool (the draft tree's ancestors)."""
    if backend == "pallas":
        from jspec.pallas.paged_decode import paged_decode

        return paged_decode(
            q, k_cache, v_cache, layer, seq_lens, page_tables, sm_scale=sm_scale, return_lse=True
        )
    from jspec.pallas.ref import paged_decode_ref

    return paged_decode_ref(q, k_cache, v_cache, layer, seq_lens, page_tables, sm_scale=sm_scale, return_lse=True)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Softmax-merges two attentions over disjoint key sets: out [..., D], lse [...]."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = wa + wb
    out = (out_a * wa[..., None] + out_b * wb[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]
    return out


def dense_attention_with_lse(q, k, v, visible, *, sm_scale: float):
    """q [R, Hq, D]; k, v [R, K, Hkv, D]; visible [R, K] -> (out [R, Hq, D] f32, lse [R, Hq] f32)."""
    R, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(R, Hkv, Hq // Hkv, D)
    s = jnp.einsum("rhgd,rkhd->rhgk", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) * sm_scale
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(visible[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("rhgk,rkhd->rhgd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(R, Hq, D), lse.reshape(R, Hq)

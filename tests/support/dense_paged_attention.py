"""The gather-everything paged attention that jspec.kernels.ref used to be: a dense oracle.

Every sequence's whole page table is gathered into [B, max_pages * S, H, D] and a
[B, Q, Hkv, G, K] logit tensor is built, so its cost follows the table width; it is
kept only to check the chunked references (and through them the kernels) by an
independent route.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _layer_index(layer: jax.Array) -> jax.Array:
    return jnp.reshape(jnp.asarray(layer, jnp.int32), ())


def gather_sequence_kv(cache: jax.Array, layer: jax.Array, seq_lens: jax.Array, page_tables: jax.Array) -> jax.Array:
    """[L, P, S, H, D] -> [B, max_pages * S, H, D] in f32, zero past each sequence's length.

    Positions past seq_len are zeroed (not just masked later) because a NaN there
    would survive a zero attention weight (0 * NaN = NaN).
    """
    _, num_pages, page_size, num_heads, head_dim = cache.shape
    batch, max_pages = page_tables.shape
    pages = jnp.clip(page_tables, 0, num_pages - 1)
    kv = cache[_layer_index(layer)][pages].reshape(batch, max_pages * page_size, num_heads, head_dim)
    valid = jnp.arange(max_pages * page_size)[None, :] < seq_lens[:, None]
    return jnp.where(valid[:, :, None, None], kv.astype(jnp.float32), 0.0)


def _masked_softmax_attention(q, k, v, visible, sm_scale, return_lse=False):
    """q [B, Q, Hkv, G, D], k/v [B, K, Hkv, D], visible [B, Q, K] -> [B, Q, Hkv, G, D] f32
    (and, with return_lse, the natural-log log-sum-exp [B, Q, Hkv, G], -inf where nothing is visible).

    Rows with nothing visible come out as zeros.
    """
    logits = jnp.einsum("bqhgd,bkhd->bqhgk", q, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    visible = visible[:, :, None, None, :]
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(visible, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("bqhgk,bkhd->bqhgd", weights, v, precision=jax.lax.Precision.HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)
    if return_lse:
        positive = denom[..., 0] > 0
        lse = jnp.where(positive, row_max[..., 0] + jnp.log(jnp.where(positive, denom[..., 0], 1.0)), -jnp.inf)
        return out, lse
    return out


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_lse"))
def dense_decode(q, k_cache, v_cache, layer, seq_lens, page_tables, *, sm_scale, return_lse=False):
    """paged_decode_ref's contract: q [B, Hq, D] -> [B, Hq, D] in q's dtype (f32 and lse with return_lse)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    group = num_q_heads // num_kv_heads
    k = gather_sequence_kv(k_cache, layer, seq_lens, page_tables)
    v = gather_sequence_kv(v_cache, layer, seq_lens, page_tables)
    visible = jnp.arange(k.shape[1])[None, None, :] < seq_lens[:, None, None]
    q5 = q.astype(jnp.float32).reshape(batch, 1, num_kv_heads, group, head_dim)
    if return_lse:
        out, lse = _masked_softmax_attention(q5, k, v, visible, sm_scale, return_lse=True)
        return out.reshape(batch, num_q_heads, head_dim), lse.reshape(batch, num_q_heads)
    out = _masked_softmax_attention(q5, k, v, visible, sm_scale)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def ragged_row_owner(query_start: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each flat row t: (sequence b, index i within b's new tokens, is t a real row)."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # Sequences whose rows all end at or before t come before t's owner (qlen-0 ones included).
    owner = jnp.searchsorted(query_start[1:], rows, side="right").astype(jnp.int32)
    owner = jnp.minimum(owner, query_start.shape[0] - 2)
    index_in_seq = rows - query_start[owner]
    return owner, index_in_seq, rows < query_start[-1]


def extend_visibility(seq_lens, query_start, max_q_len: int, num_kv: int, mask=None) -> jax.Array:
    """visible[b, i, j]: may new token i of sequence b attend to KV position j."""
    q_lens = query_start[1:] - query_start[:-1]
    prefix = (seq_lens - q_lens)[:, None, None]
    i = jnp.arange(max_q_len)[None, :, None]
    j = jnp.arange(num_kv)[None, None, :]
    in_seq = (j < seq_lens[:, None, None]) & (i < q_lens[:, None, None])
    if mask is None:
        return in_seq & (j <= prefix + i)
    new_index = j - prefix
    in_new = (new_index >= 0) & (new_index < max_q_len)
    tree = jnp.take_along_axis(
        mask.astype(bool),
        jnp.broadcast_to(jnp.clip(new_index, 0, max_q_len - 1), (mask.shape[0], max_q_len, num_kv)),
        axis=2,
    )
    return in_seq & ((new_index < 0) | (in_new & tree))


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_q_len"))
def dense_extend(q, k_cache, v_cache, layer, seq_lens, page_tables, query_start, *, sm_scale, max_q_len, mask=None):
    """paged_extend_ref's contract: ragged q [T, Hq, D] -> [T, Hq, D], rows from query_start[B] on zeros."""
    num_rows, num_q_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[3]
    group = num_q_heads // num_kv_heads
    k = gather_sequence_kv(k_cache, layer, seq_lens, page_tables)
    v = gather_sequence_kv(v_cache, layer, seq_lens, page_tables)

    # Ragged rows -> [B, max_q_len] padded layout, attention there, then back.
    q_lens = query_start[1:] - query_start[:-1]
    i = jnp.arange(max_q_len)[None, :]
    padded_rows = jnp.clip(query_start[:-1, None] + i, 0, num_rows - 1)
    q_padded = q.astype(jnp.float32)[padded_rows]  # [B, Q, Hq, D]
    q_padded = jnp.where((i < q_lens[:, None])[:, :, None, None], q_padded, 0.0)
    q5 = q_padded.reshape(batch, max_q_len, num_kv_heads, group, head_dim)
    visible = extend_visibility(seq_lens, query_start, max_q_len, k.shape[1], mask)
    out = _masked_softmax_attention(q5, k, v, visible, sm_scale).reshape(batch, max_q_len, num_q_heads, head_dim)

    owner, index_in_seq, real = ragged_row_owner(query_start, num_rows)
    flat = out[owner, jnp.clip(index_in_seq, 0, max_q_len - 1)]
    return jnp.where(real[:, None, None], flat, 0.0).astype(q.dtype)

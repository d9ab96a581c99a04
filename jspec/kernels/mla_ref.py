"""Pure-jnp multi-head latent attention (DeepSeek's MLA) over a paged latent cache: the
specification of the MLA kernels, and the CPU backend's MLA.

The cache holds one latent "head" per token, [c_kv (kv_lora_rank) | k_rope (qk_rope_head_dim)].
Two equal ways to attend to it:

- absorbed: each query head folds the key up-projection into its query
  (q_nope @ W_UK -> kv_lora_rank wide), so every head attends to the latent itself (MQA
  with one KV head; the value is c_kv, the latent's first kv_lora_rank columns), and the
  output is projected up by W_UV afterwards. Per cached token it reads latent_dim numbers
  once for all heads and expands nothing: the form for decode and verify, whose few queries
  per sequence face a long cache.
- expanded: the latent of each cached token is projected up to per-head keys (nope | rope)
  and values, and the heads attend as ordinary multi-head attention of head dim
  qk_nope + qk_rope. The expansion costs kv_lora_rank x heads x (nope + v) per cached token,
  paid back when as many queries as keys arrive (prefill), since each score is then a
  qk_head_dim-wide product instead of a latent_dim-wide one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jspec.kernels.ref import (
    HIGHEST,
    KV_CHUNK,
    _attend_chunk,
    _finish,
    _gather_chunk,
    _kv_lens,
    _layer_index,
    _pages_per_chunk,
    _Softmax,
    paged_decode_ref,
    paged_extend_ref,
)


def mla_decode_ref(q, latent_cache, layer, seq_lens, page_tables, *, kv_lora_rank, sm_scale, kv_chunk=KV_CHUNK):
    """Absorbed MLA decode: q [B, Hq, latent_dim] (absorbed nope | rope), latent_cache
    [L, P, S, 1, latent_dim] -> [B, Hq, kv_lora_rank] in q's dtype (before W_UV).

    The value is the latent itself; the reference attends with the whole latent as value and
    keeps its first kv_lora_rank columns (the rest are the RoPE key, not a value)."""
    out = paged_decode_ref(
        q, latent_cache, latent_cache, layer, seq_lens, page_tables, sm_scale=sm_scale, kv_chunk=kv_chunk
    )
    return out[..., :kv_lora_rank]


def mla_extend_ref(
    q,
    latent_cache,
    layer,
    seq_lens,
    page_tables,
    query_start,
    *,
    kv_lora_rank,
    sm_scale,
    max_q_len,
    mask=None,
    kv_chunk=KV_CHUNK,
):
    """Absorbed MLA over ragged new tokens (paged_extend_ref's batch layout and tree mask):
    q [T, Hq, latent_dim] -> [T, Hq, kv_lora_rank]."""
    out = paged_extend_ref(
        q,
        latent_cache,
        latent_cache,
        layer,
        seq_lens,
        page_tables,
        query_start,
        sm_scale=sm_scale,
        max_q_len=max_q_len,
        mask=mask,
        kv_chunk=kv_chunk,
    )
    return out[..., :kv_lora_rank]


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_q_len", "kv_chunk"))
def mla_extend_expanded_ref(
    q_nope,
    q_rope,
    latent_cache,
    w_uk,
    w_uv,
    layer,
    seq_lens,
    page_tables,
    query_start,
    *,
    sm_scale,
    max_q_len,
    kv_chunk=KV_CHUNK,
):
    """Expanded MLA, causal, over ragged new tokens: q_nope [T, Hq, nope], q_rope [T, Hq, rope],
    w_uk [Hq, nope, R], w_uv [Hq, v, R] -> [T, Hq, v] f32. Each chunk of a sequence's cached
    latents is projected up to per-head keys and values before it is attended to."""
    num_rows, heads, nope = q_nope.shape
    rank, v_dim = w_uk.shape[2], w_uv.shape[1]
    batch = seq_lens.shape[0]
    page_size = latent_cache.shape[2]
    layer = _layer_index(layer)
    query_start = query_start.astype(jnp.int32)
    q_lens = query_start[1:] - query_start[:-1]
    kv_lens = _kv_lens(seq_lens, page_tables, page_size)
    pages_per_chunk = _pages_per_chunk(page_size, page_tables.shape[1], kv_chunk)
    chunk_len = pages_per_chunk * page_size
    q = jnp.concatenate([q_nope, q_rope], axis=-1).astype(jnp.float32)
    D = q.shape[-1]
    q_padded = jnp.zeros((num_rows + max_q_len, heads, D), jnp.float32).at[:num_rows].set(q)
    out0 = jnp.zeros((num_rows + max_q_len, heads, v_dim), jnp.float32)
    w_uk, w_uv = w_uk.astype(jnp.float32), w_uv.astype(jnp.float32)
    i = jnp.arange(max_q_len)

    def attend_sequence(b, out):
        start, q_len, kv_len = query_start[b], q_lens[b], kv_lens[b]
        prefix = kv_len - q_len
        own = i < q_len
        window = lax.dynamic_slice_in_dim(q_padded, start, max_q_len)
        qb = jnp.where(own[:, None, None], window, 0.0).reshape(1, max_q_len, heads, 1, D)
        table = lax.dynamic_slice_in_dim(page_tables, b, 1)

        def step(chunk, state):
            latent, positions = _gather_chunk(latent_cache, layer, table, kv_len[None], chunk, pages_per_chunk)
            c, k_rope = latent[:, :, 0, :rank], latent[:, :, 0, rank:]
            k_nope = jnp.einsum("rcl,hnl->rchn", c, w_uk, precision=HIGHEST)
            k_rope = jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1]))
            k = jnp.concatenate([k_nope, k_rope], axis=-1)
            v = jnp.einsum("rcl,hvl->rchv", c, w_uv, precision=HIGHEST)
            j = positions[None, :]
            visible = own[:, None] & (j < kv_len) & (j <= prefix + i[:, None])
            return _attend_chunk(state, qb, k, v, visible[None], sm_scale)

        rows = (1, max_q_len, heads, 1)
        empty = _Softmax(
            jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros((*rows, v_dim), jnp.float32)
        )
        num_chunks = jnp.where(q_len > 0, -(-kv_len // chunk_len), 0)
        res, _ = _finish(lax.fori_loop(0, num_chunks, step, empty))
        res = res.reshape(max_q_len, heads, v_dim)
        old = lax.dynamic_slice_in_dim(out, start, max_q_len)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(own[:, None, None], res, old), start, axis=0)

    num_seqs = jnp.max(jnp.where(q_lens > 0, jnp.arange(1, batch + 1), 0), initial=0)
    return lax.fori_loop(0, num_seqs, attend_sequence, out0)[:num_rows]

"""Pure-jnp paged attention: the specification the Pallas kernels are tested against,
and the model's attention off the GPU.

Both references walk the KV a chunk of whole pages at a time with an online
softmax in f32, for as many chunks as the actual lengths need (a loop with a
traced trip count), so time and memory follow the sequences, not the page-table
width. The extend reference also runs one real sequence at a time, so a padded
batch costs nothing for its padding.

A sliding window (window: an int32 () array, None for none) hides keys window
or more positions behind the query; the loops then start at the first chunk
any window reaches. Under a tree mask a node's position is prefix + depth. logit_softcap c
turns the scaled logits into c * tanh(logits / c) (Gemma 2). sinks (f32 [Hq], gpt-oss)
are per-head logits of a key with value zero that every query sees: they join the
softmax's denominator only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jspec.kernels.paged_tiles import kv_values, tree_depth, window_scalar

KV_CHUNK = 256  # KV tokens per loop step, rounded to whole pages
# Every dot here pins it: the references are float32 on every backend, whatever
# jax_default_matmul_precision says (docs/design-details.md, "Precision").
HIGHEST = lax.Precision.HIGHEST


class _Softmax(NamedTuple):
    """Online-softmax state of query rows [..., Hkv, G]: running max, normaliser, unnormalised output."""

    m: jax.Array  # natural-log units, -inf while a row has seen nothing
    l: jax.Array
    acc: jax.Array  # [..., Hkv, G, D]


def _layer_index(layer: jax.Array) -> jax.Array:
    return jnp.reshape(jnp.asarray(layer, jnp.int32), ())


def _pages_per_chunk(page_size: int, max_pages: int, kv_chunk: int) -> int:
    # At least one page (a page may hold more than kv_chunk tokens), and no more than the table has.
    return max(1, min(kv_chunk // page_size, max_pages))


def _kv_lens(seq_lens, page_tables, page_size):
    # A length past what the table can address would index past it: clamp, as the kernels do.
    return jnp.clip(seq_lens.astype(jnp.int32), 0, page_tables.shape[1] * page_size)


def _gather_chunk(cache, layer, page_tables, kv_lens, chunk, pages_per_chunk):
    """KV chunk `chunk` of each row of page_tables [R, max_pages]: ([R, C, H, D] f32, positions [C]),
    C = pages_per_chunk * page_size, zero at positions >= kv_lens [R].

    Zeroed, not just masked later: a NaN there would survive a zero weight (0 * NaN = NaN).
    """
    _, num_pages, page_size, num_heads, head_dim = cache.shape
    rows, max_pages = page_tables.shape
    slots = chunk * pages_per_chunk + jnp.arange(pages_per_chunk)
    # The last chunk may run past the table, and slots past a sequence's pages hold
    # garbage ids: clip both to some page; what is read there is zeroed below.
    pages = jnp.clip(page_tables[:, jnp.minimum(slots, max_pages - 1)], 0, num_pages - 1)
    kv = kv_values(cache[layer, pages]).reshape(rows, pages_per_chunk * page_size, num_heads, head_dim)
    positions = chunk * pages_per_chunk * page_size + jnp.arange(pages_per_chunk * page_size)
    valid = positions[None, :] < kv_lens[:, None]
    return jnp.where(valid[:, :, None, None], kv.astype(jnp.float32), 0.0), positions


def _empty(q: jax.Array, sinks=None) -> _Softmax:
    """The state of rows q [..., Hkv, G, D] that have seen nothing, or only their head's sink
    (sinks [Hkv * G]: a key of that logit and value zero)."""
    rows = q.shape[:-1]
    acc = jnp.zeros(q.shape, jnp.float32)
    if sinks is None:
        return _Softmax(jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32), acc)
    m = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(rows[-2:]), rows)
    return _Softmax(m, jnp.ones(rows, jnp.float32), acc)


def _attend_chunk(state: _Softmax, q, k, v, visible, sm_scale, softcap=None) -> _Softmax:
    """One online-softmax step of q [R, Q, Hkv, G, D] over k, v [R, C, Hkv, D]; visible [R, Q, C]."""
    logits = jnp.einsum("rqhgd,rchd->rqhgc", q, k, precision=HIGHEST) * sm_scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    visible = visible[:, :, None, None, :]
    logits = jnp.where(visible, logits, -jnp.inf)
    m = jnp.maximum(state.m, jnp.max(logits, axis=-1))
    # Rows that have seen nothing yet keep m = -inf; shift them by 0 so that no -inf - -inf appears.
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    alpha = jnp.exp(state.m - shift)
    weights = jnp.exp(logits - shift[..., None])  # exactly 0 where not visible
    l = state.l * alpha + jnp.sum(weights, axis=-1)
    acc = state.acc * alpha[..., None] + jnp.einsum("rqhgc,rchd->rqhgd", weights, v, precision=HIGHEST)
    return _Softmax(m, l, acc)


def _finish(state: _Softmax) -> tuple[jax.Array, jax.Array]:
    """(out, natural-log lse): zeros and -inf for rows that saw nothing."""
    seen = state.l > 0
    l = jnp.where(seen, state.l, 1.0)
    return state.acc / l[..., None], jnp.where(seen, state.m + jnp.log(l), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("sm_scale", "return_lse", "kv_chunk", "logit_softcap"))
def paged_decode_ref(
    q,
    k_cache,
    v_cache,
    layer,
    seq_lens,
    page_tables,
    *,
    sm_scale,
    return_lse=False,
    kv_chunk=KV_CHUNK,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """One new query token per sequence. q [B, Hq, D] -> [B, Hq, D] in q's dtype.

    With return_lse: (out [B, Hq, D] f32, lse [B, Hq] f32 natural log, -inf for seq_len 0).
    kv_chunk: KV tokens per loop step (rounded to whole pages); changes only the summation order.
    """
    batch, num_q_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    layer = _layer_index(layer)
    kv_lens = _kv_lens(seq_lens, page_tables, page_size)
    pages_per_chunk = _pages_per_chunk(page_size, page_tables.shape[1], kv_chunk)
    q5 = q.astype(jnp.float32).reshape(batch, 1, num_kv_heads, group, head_dim)
    window_start = jnp.maximum(kv_lens - window_scalar(window), 0)  # the query sits at kv_len - 1

    def step(chunk, state):
        k, positions = _gather_chunk(k_cache, layer, page_tables, kv_lens, chunk, pages_per_chunk)
        v, _ = _gather_chunk(v_cache, layer, page_tables, kv_lens, chunk, pages_per_chunk)
        visible = (positions[None, :] < kv_lens[:, None]) & (positions[None, :] >= window_start[:, None])
        return _attend_chunk(state, q5, k, v, visible[:, None, :], sm_scale, logit_softcap)

    # The whole batch steps together, from the lowest window start to the longest sequence's end.
    chunk_len = pages_per_chunk * page_size
    num_chunks = -(-jnp.max(kv_lens, initial=0) // chunk_len)
    first_chunk = jnp.min(jnp.where(kv_lens > 0, window_start, jnp.iinfo(jnp.int32).max), initial=0) // chunk_len
    out, lse = _finish(lax.fori_loop(jnp.minimum(first_chunk, num_chunks), num_chunks, step, _empty(q5, sinks)))
    out = out.reshape(batch, num_q_heads, head_dim)
    if return_lse:
        return out, lse.reshape(batch, num_q_heads)
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "max_q_len", "kv_chunk", "logit_softcap"))
def paged_extend_ref(
    q,
    k_cache,
    v_cache,
    layer,
    seq_lens,
    page_tables,
    query_start,
    *,
    sm_scale,
    max_q_len,
    mask=None,
    kv_chunk=KV_CHUNK,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """Ragged new tokens attending to their sequence's paged KV. q [T, Hq, D] -> [T, Hq, D].

    Sequence b owns rows query_start[b]:query_start[b+1]; they are the last qlen_b
    of its seq_lens[b] KV entries. Causal by default; with mask [B, Q, Q] the
    prefix is fully visible and new token i sees new token k iff mask[b, i, k].
    Rows at or past query_start[B] are zeros. kv_chunk as in paged_decode_ref.
    window: a query at position p sees keys > p - window only; a tree node's position
    is prefix + its depth, and it sees all its ancestors.
    """
    num_rows, num_q_heads, head_dim = q.shape
    batch = seq_lens.shape[0]
    _, _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    layer = _layer_index(layer)
    query_start = query_start.astype(jnp.int32)
    q_lens = query_start[1:] - query_start[:-1]
    kv_lens = _kv_lens(seq_lens, page_tables, page_size)
    pages_per_chunk = _pages_per_chunk(page_size, page_tables.shape[1], kv_chunk)
    chunk_len = pages_per_chunk * page_size
    # max_q_len spare rows at the end, so that a window of max_q_len rows from any
    # sequence's first row stays in bounds (dynamic_slice would shift it back).
    zeros = jnp.zeros((num_rows + max_q_len, num_q_heads, head_dim), jnp.float32)
    q_padded = zeros.at[:num_rows].set(q.astype(jnp.float32))
    i = jnp.arange(max_q_len)  # row within a sequence's window
    sliding = window_scalar(window)
    depths = None if mask is None else tree_depth(mask)

    def attend_sequence(b, out):
        start, q_len, kv_len = query_start[b], q_lens[b], kv_lens[b]
        prefix = kv_len - q_len  # KV entries before the new tokens
        own = i < q_len  # the window's other rows belong to later sequences, or are padding (maybe NaN)
        window = lax.dynamic_slice_in_dim(q_padded, start, max_q_len)
        qb = jnp.where(own[:, None, None], window, 0.0).reshape(1, max_q_len, num_kv_heads, group, head_dim)
        table = lax.dynamic_slice_in_dim(page_tables, b, 1)
        row_pos = prefix + (i if mask is None else depths[b])
        window_start = jnp.maximum(row_pos - sliding + 1, 0)

        def step(chunk, state):
            k, positions = _gather_chunk(k_cache, layer, table, kv_len[None], chunk, pages_per_chunk)
            v, _ = _gather_chunk(v_cache, layer, table, kv_len[None], chunk, pages_per_chunk)
            j = positions[None, :]
            visible = own[:, None] & (j < kv_len)
            if mask is None:
                visible &= j <= prefix + i[:, None]
            else:
                new_index = j - prefix
                tree = jnp.take(mask[b].astype(bool), jnp.clip(new_index[0], 0, max_q_len - 1), axis=1)
                visible &= (new_index < 0) | tree
            visible &= j >= window_start[:, None]
            return _attend_chunk(state, qb, k, v, visible[None], sm_scale, logit_softcap)

        # The last new token sees the whole sequence: that is as far as any row reaches.
        num_chunks = jnp.where(q_len > 0, -(-kv_len // chunk_len), 0)
        first_chunk = jnp.minimum(jnp.min(window_start) // chunk_len, num_chunks)
        rows, _ = _finish(lax.fori_loop(first_chunk, num_chunks, step, _empty(qb, sinks)))
        rows = rows.reshape(max_q_len, num_q_heads, head_dim)
        # Write back this sequence's rows only: the rest of the window is not its own.
        old = lax.dynamic_slice_in_dim(out, start, max_q_len)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(own[:, None, None], rows, old), start, axis=0)

    # Padding sequences (qlen 0) come last: stop after the last real one. One with
    # qlen 0 in between costs a window copy and no KV.
    num_seqs = jnp.max(jnp.where(q_lens > 0, jnp.arange(1, batch + 1), 0), initial=0)
    out = lax.fori_loop(0, num_seqs, attend_sequence, zeros)
    return out[:num_rows].astype(q.dtype)


def dequantize_fp8(w, scale):
    """w [..., in, out] (FP8) and scale [..., in_blocks, out] f32 -> f32 [..., in, out]: each scale
    row multiplies in / in_blocks consecutive rows of w."""
    *lead, K, N = w.shape
    nb = scale.shape[-2]
    blocks = w.astype(jnp.float32).reshape(*lead, nb, K // nb, N) * scale[..., :, None, :]
    return blocks.reshape(*lead, K, N)


def skinny_matmul_ref(x, w, scale=None):
    """x [M, K] @ w [K, N] -> f32 [M, N]: x cast to w's dtype, products accumulated in f32.

    The same contract as the skinny_matmul kernel (and the models' jnp.dot with
    preferred_element_type=f32), so the two differ only in summation order. With scale
    (FP8 w): x @ dequantize_fp8(w, scale), in f32. At HIGHEST, as every reference's dots: float32
    on every backend (the GPU's default would round float32 operands to TF32).
    """
    if scale is not None:
        return jnp.dot(x.astype(jnp.float32), dequantize_fp8(w, scale), precision=HIGHEST)
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32, precision=HIGHEST)

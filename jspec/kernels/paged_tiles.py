"""Building blocks shared by the paged decode and extend kernels.

In-kernel helpers (called inside a Pallas kernel body) gather KV tiles through
the page table and run one online-softmax step; host-side helpers choose the
split-K partition and merge the partial results in jnp.

Two constraints of jax 0.11.2 shape every gather here:
- the Triton lowering requires every loaded/stored array to have a power-of-2
  size, so tiles are padded and masked rather than sized to the data;
- interpret mode cannot mix slices with array indices in one load (the
  discharge rule raises NotImplementedError), so every gather indexes every
  dimension with a scalar or an int array, including an iota over head_dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

# Finite on purpose: the rescale factor exp2(m_old - m_new) would be NaN if both
# were -inf, i.e. for a row that has seen only masked positions so far.
MASK_VALUE = -1e30
LOG2E = math.log2(math.e)

# H200: 132 SMs. Split the context only while the grid has fewer than two
# programs per SM, and then aim for four, so that the loads of one resident
# program overlap the math of another.
NUM_SMS = 132
TARGET_PROGRAMS = 4 * NUM_SMS


# The window of a layer that has none: wider than any context, small enough that
# position - window stays in int32.
NO_WINDOW = 1 << 30


def window_scalar(window) -> jax.Array:
    """A kernel's window argument (None or an int32 array of one element) as an int32 ()."""
    if window is None:
        return jnp.int32(NO_WINDOW)
    return jnp.reshape(jnp.asarray(window, jnp.int32), ())


def tree_depth(mask: jax.Array) -> jax.Array:
    """[B, Q, Q] tree mask (each node sees itself and its ancestors) -> int32 [B, Q] depth of
    each node below the tree's first token: its position past the prefix."""
    return jnp.maximum(jnp.sum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def largest_pow2_upto(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return next_pow2(n + 1) // 2 if n >= 1 else 1


def check_pow2(name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")


def cache_rows(cache: jax.Array) -> jax.Array:
    """[L, P, S, H, D] -> [L*P*S*H, D]: a free reshape that lets a kernel address KV by row.

    One int32 row index per token (computed on a [block_n] vector) then costs
    one multiply-add per element in the gather, instead of one per cache dim.
    """
    return cache.reshape(-1, cache.shape[-1])


def gather_kv_tiles(
    k_rows_ref, v_rows_ref, page_tables_ref, *, cache_shape, layer, seq, kv_head, start, block_n, valid_len=None
):
    """K and V rows start..start+block_n of one sequence and kv head: two [block_n, D] tiles.

    k_rows_ref, v_rows_ref: the caches as cache_rows() views; cache_shape their
    (L, P, S, H, D). Each token's row is looked up through the page table, so a
    tile may span several pages (page_size < block_n) or part of one. With
    valid_len, tokens at or past it are neither read nor looked up: they come
    back as zeros (a NaN there would survive a zero softmax weight).
    """
    _, num_pages, page_size, num_kv_heads, head_dim = cache_shape
    tokens = start + lax.iota(jnp.int32, block_n)
    if page_size == 1:
        slots, offsets = tokens, 0
    else:
        slots, offsets = lax.div(tokens, page_size), lax.rem(tokens, page_size)
    valid = None if valid_len is None else tokens < valid_len
    if valid is None:
        pages = page_tables_ref[seq, slots]
    else:
        pages = pltriton.load(page_tables_ref.at[seq, slots], mask=valid, other=0)
    # Row of (layer, page, offset, kv_head) in [L*P*S*H, D]; < 2**31 for any cache under 512 GiB at D=128.
    rows = (((layer * num_pages + pages) * page_size + offsets) * num_kv_heads + kv_head)[:, None]
    cols = lax.iota(jnp.int32, head_dim)[None, :]
    if valid is None:
        return k_rows_ref[rows, cols], v_rows_ref[rows, cols]
    k = pltriton.load(k_rows_ref.at[rows, cols], mask=valid[:, None], other=0)
    v = pltriton.load(v_rows_ref.at[rows, cols], mask=valid[:, None], other=0)
    return k, v


def attend_tile(q, k, v, m, l, acc, *, scale_log2, visible=None, softcap=None):
    """One online-softmax step of rows q [M, D] over a KV tile [N, D], in base 2.

    m, l: running max (log2 units) and normaliser [M]; acc: unnormalised [M, D] f32.
    visible [M, N] (or broadcastable) hides positions; None means all visible.
    softcap: logits (natural units, after scaling) become softcap * tanh(logits / softcap).
    An FP8 KV tile (bytes: see FP8_KV_BYTES) is upcast to q's dtype here, in registers.
    """
    k, v = kv_values(k).astype(q.dtype), kv_values(v).astype(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if softcap is None:
        s = s * scale_log2
    else:
        s = jnp.tanh(s * (scale_log2 / (LOG2E * softcap))) * (softcap * LOG2E)
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if visible is not None:
        # A row with nothing visible yet has m_new == MASK_VALUE and p == 1 here.
        p = jnp.where(visible, p, 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[:, None] + pv


# An FP8 KV pool holds e4m3 values as their bytes: XLA:CPU has no FP8 scatter (it converts the
# whole pool to f16 and back around every KV write), a byte scatter every backend has, and a
# same-width bitcast is free wherever the bytes are read.
FP8_KV_BYTES = jnp.uint8
FP8_KV = jnp.float8_e4m3fn


def kv_values(x: jax.Array) -> jax.Array:
    """KV as numbers: an FP8 pool's bytes bitcast to e4m3, any other pool as it is."""
    return lax.bitcast_convert_type(x, FP8_KV) if x.dtype == FP8_KV_BYTES else x


def kv_compute_dtype(cache_dtype, q_dtype):
    """The dtype of the attention's dots: the cache's, or q's over an FP8 cache (whose tiles are
    upcast after their load: the HBM read stays one byte per element)."""
    return q_dtype if jnp.dtype(cache_dtype) == FP8_KV_BYTES else cache_dtype


def initial_state(rows: int, head_dim: int):
    """The online-softmax carry (m, l, acc) of rows that have seen nothing."""
    return (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )


def with_sink(carry, sink, *, first_split):
    """carry as if each row had already seen a key of logit sink [rows] (natural units) and
    value zero: an attention sink. Only the first split takes it, so merging counts it once."""
    m, l, acc = carry
    return jnp.where(first_split, sink * LOG2E, m), jnp.where(first_split, 1.0, l), acc


def normalise(acc, l):
    """acc / l, with rows that saw nothing (l == 0) as zeros."""
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


def choose_splits(max_kv: int, programs: int, block_n: int, min_split_tokens: int, num_splits: int | None):
    """(num_splits, split_len): split a context of max_kv tokens so that enough programs run.

    The number of splits is a grid dimension, so it is chosen from static shapes:
    max_kv is the widest context the page table can address. split_len is what
    that widest context would get; the launch spreads the batch's actual longest
    sequence over the splits instead (runtime_split_len).
    """
    blocks = max(1, -(-max_kv // block_n))
    if num_splits is None:
        enough = programs >= 2 * NUM_SMS
        wanted = 1 if enough else next_pow2(-(-TARGET_PROGRAMS // max(programs, 1)))
        most = max(1, max_kv // max(min_split_tokens, block_n))
        num_splits = max(1, min(wanted, most))
    num_splits = max(1, min(num_splits, blocks))
    split_len = -(-blocks // num_splits) * block_n
    return -(-max_kv // split_len), split_len


def min_split_len(block_n: int, min_split_tokens: int, num_splits: int | None) -> int:
    """Floor of the runtime split length, a multiple of block_n.

    An explicit num_splits is taken at its word (as in choose_splits): only the
    automatic choice keeps splits min_split_tokens long.
    """
    if num_splits is not None:
        return block_n
    return -(-max(min_split_tokens, block_n) // block_n) * block_n


def runtime_split_len(kv_lens: jax.Array, num_splits: int, block_n: int, floor: int) -> jax.Array:
    """KV tokens per split for this batch: a [1] int32 kernel input.

    The longest of kv_lens [B] spread evenly over the num_splits splits, at least
    floor, rounded up to a multiple of block_n so that only a sequence's last
    tile is partial. Splits past a sequence's end do nothing, so a short
    sequence in a wide page table costs what its length needs.
    """
    longest = jnp.max(kv_lens.astype(jnp.int32), initial=0)
    per_split = jnp.maximum(-(-longest // num_splits), floor)
    return jnp.reshape(-(-per_split // block_n) * block_n, (1,)).astype(jnp.int32)


def lse_of_splits(m, l, axis: int):
    """The natural-log log-sum-exp of the scaled logits from split-K partials m (log2 units) and
    l, over axis; -inf where every split is empty."""
    m_max = jnp.max(m, axis=axis)
    total = jnp.sum(jnp.exp2(m - jnp.expand_dims(m_max, axis)) * l, axis=axis)
    return jnp.where(total > 0, (m_max + jnp.log2(jnp.where(total > 0, total, 1.0))) * math.log(2.0), -jnp.inf)


def merge_splits(acc, m, l, axis: int):
    """Merges split-K partials: acc [..., NS, ..., D], m and l [..., NS, ...] -> normalised f32.

    m is in log2 units. Empty splits carry m == MASK_VALUE and l == 0 and vanish;
    if every split is empty the result is zero.
    """
    m_max = jnp.max(m, axis=axis, keepdims=True)
    weight = jnp.exp2(m - m_max)
    total = jnp.sum(weight * l, axis=axis)
    out = jnp.sum(weight[..., None] * acc, axis=axis)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def query_block_count(batch: int, num_q_blocks: int, tokens_per_block: int, num_rows: int | None) -> int:
    """Query blocks an extend grid must hold for any ragged batch of `num_rows` rows over `batch`
    sequences of at most num_q_blocks blocks: each sequence's whole blocks and at most one
    partial one (None rows: batch x num_q_blocks)."""
    most = batch * num_q_blocks
    return most if num_rows is None else min(most, -(-num_rows // tokens_per_block) + min(batch, num_rows))


def query_block_table(q_lens, tokens_per_block: int, num_items: int) -> tuple[jax.Array, jax.Array]:
    """(sequence [num_items], query block [num_items]) of each grid entry: every sequence's
    blocks in turn, its highest first (under a causal mask they read the most KV, and starting
    them early keeps the last wave short); -1 and 0 past the batch's blocks."""
    counts = -(-q_lens // tokens_per_block)
    ends = jnp.cumsum(counts)
    item = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, item, side="right").astype(jnp.int32)
    real = item < ends[-1]
    seq = jnp.where(real, seq, -1)
    within = item - (ends - counts)[jnp.maximum(seq, 0)]
    block = jnp.where(real, counts[jnp.maximum(seq, 0)] - 1 - within, 0)
    return seq, block.astype(jnp.int32)

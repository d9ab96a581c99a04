"""Absorbed multi-head latent attention (DeepSeek's MLA), Pallas over Triton: decode, and the
extend of a few new tokens per sequence (verify trees, causal or masked).

One query token per sequence; every query head attends to the same latent cache row
[c_kv (R) | k_rope (P)] (kernels/mla_ref.py explains the absorbed form). Grid (sequence,
head block, context split): a program holds block_h query heads, so a latent tile is read
once for all of them, and uses it twice: the score is q_lat . c + q_rope . k_rope and the
value is c itself. Split-K partials are merged in jnp as in paged_decode. R and P must be
powers of two (DeepSeek-V3: 512 and 64), since Triton tiles are.

mla_extend runs one program per (sequence, new token, head block) over the keys that token
sees (the prefix, then the new tokens its causal order or tree mask allows), so the latent is
read once per new token: right for verify trees of a few nodes; prefills take the expanded
form (kernels/mla_ref.py) instead.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.kernels.backend import resolve_interpret
from jspec.kernels.paged_tiles import (
    LOG2E,
    MASK_VALUE,
    cache_rows,
    check_pow2,
    choose_splits,
    merge_splits,
    min_split_len,
    next_pow2,
    runtime_split_len,
)


def _latent_tiles(rows_ref, page_tables_ref, *, cache_shape, rank, layer, seq, start, block_n, valid_len):
    """Latent rows start..start+block_n of one sequence: (c [block_n, R], k_rope [block_n, P]);
    tokens at or past valid_len come back as zeros, unread."""
    _, num_pages, page_size, _, width = cache_shape
    tokens = start + lax.iota(jnp.int32, block_n)
    valid = tokens < valid_len
    pages = pltriton.load(page_tables_ref.at[seq, lax.div(tokens, page_size)], mask=valid, other=0)
    rows = ((layer * num_pages + pages) * page_size + lax.rem(tokens, page_size))[:, None]
    c = pltriton.load(rows_ref.at[rows, lax.iota(jnp.int32, rank)[None, :]], mask=valid[:, None], other=0)
    rope_cols = rank + lax.iota(jnp.int32, width - rank)[None, :]
    k_rope = pltriton.load(rows_ref.at[rows, rope_cols], mask=valid[:, None], other=0)
    return c, k_rope


def _tile_scores(q_lat, q_rope, rows_ref, page_tables_ref, *, scale_log2, **tile):
    """One KV tile's latents c [block_n, R] and the scores of the absorbed query against them
    (log2 units): q_lat . c + q_rope . k_rope."""
    c, k_rope = _latent_tiles(rows_ref, page_tables_ref, **tile)
    dims = (((1,), (1,)), ((), ()))
    s = lax.dot_general(q_lat, c, dims, preferred_element_type=jnp.float32)
    s = (s + lax.dot_general(q_rope, k_rope, dims, preferred_element_type=jnp.float32)) * scale_log2
    return c, s


def _online_softmax_step(carry, s, visible, c, dtype):
    """The running (max, normaliser, accumulator) after one tile; the latents are the values."""
    m, l, acc = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(dtype), c, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[:, None] + pv


def _empty_carry(block_h: int, rank: int):
    return (
        jnp.full((block_h,), MASK_VALUE, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
        jnp.zeros((block_h, rank), jnp.float32),
    )


def _mla_decode_kernel(
    layer_ref,
    split_len_ref,
    seq_lens_ref,
    page_tables_ref,
    q_lat_ref,
    q_rope_ref,
    rows_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    cache_shape,
    num_heads,
    block_h,
    block_n,
    scale_log2,
):
    seq, head_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rank, rope = q_lat_ref.shape[2], q_rope_ref.shape[2]
    layer = layer_ref[0]
    split_len = split_len_ref[0]
    kv_len = jnp.minimum(seq_lens_ref[seq], page_tables_ref.shape[1] * cache_shape[2])
    lo = split * split_len
    hi = jnp.minimum(lo + split_len, kv_len)
    num_tiles = -(-jnp.maximum(hi - lo, 0) // block_n)

    heads = head_block * block_h + lax.iota(jnp.int32, block_h)
    real = heads < num_heads
    h2 = heads[:, None]
    dtype = rows_ref.dtype
    q_lat = pltriton.load(q_lat_ref.at[seq, h2, lax.iota(jnp.int32, rank)[None, :]], mask=real[:, None], other=0)
    q_rope = pltriton.load(q_rope_ref.at[seq, h2, lax.iota(jnp.int32, rope)[None, :]], mask=real[:, None], other=0)
    q_lat, q_rope = q_lat.astype(dtype), q_rope.astype(dtype)

    def tile(i, carry):
        start = lo + i * block_n
        c, s = _tile_scores(
            q_lat,
            q_rope,
            rows_ref,
            page_tables_ref,
            scale_log2=scale_log2,
            cache_shape=cache_shape,
            rank=rank,
            layer=layer,
            seq=seq,
            start=start,
            block_n=block_n,
            valid_len=hi,
        )
        visible = (start + lax.iota(jnp.int32, block_n) < hi)[None, :]
        return _online_softmax_step(carry, s, visible, c, dtype)

    m, l, acc = lax.fori_loop(0, num_tiles, tile, _empty_carry(block_h, rank))
    pltriton.store(acc_ref.at[seq, split, h2, lax.iota(jnp.int32, rank)[None, :]], acc, mask=real[:, None])
    pltriton.store(m_ref.at[seq, split, heads], m, mask=real)
    pltriton.store(l_ref.at[seq, split, heads], l, mask=real)


@functools.partial(
    jax.jit,
    static_argnames=(
        "kv_lora_rank",
        "sm_scale",
        "interpret",
        "block_h",
        "block_n",
        "num_splits",
        "min_split_tokens",
        "return_lse",
    ),
)
def mla_decode(
    q,
    latent_cache,
    layer,
    seq_lens,
    page_tables,
    *,
    kv_lora_rank,
    sm_scale,
    interpret=None,
    block_h=32,
    block_n=32,
    num_splits=None,
    min_split_tokens=256,
    return_lse=False,
):
    """mla_decode_ref's contract: q [B, Hq, R + P] (absorbed nope | rope), latent_cache
    [L, pages, S, 1, R + P] -> [B, Hq, R] in q's dtype; with return_lse (out f32, lse [B, Hq]
    natural log, -inf for seq_len 0). block_h query heads per program (a power of two >= 16,
    Triton's smallest dot; fewer where the model has fewer heads), block_n latent rows per tile.
    Every program reads its sequence's whole latent, so more heads per program read it fewer
    times; 64 was slower than 32 on the GPU (bench_mla)."""
    batch, num_heads, width = q.shape
    _, _, page_size, one, cache_width = latent_cache.shape
    rank = kv_lora_rank
    if one != 1 or width != cache_width:
        raise ValueError(f"q {q.shape} does not fit the latent cache {latent_cache.shape}")
    check_pow2("page_size", page_size)
    check_pow2("block_h", block_h)
    check_pow2("block_n", block_n)
    check_pow2("kv_lora_rank", rank)
    check_pow2("qk_rope_head_dim", cache_width - rank)
    block_h = max(16, min(block_h, next_pow2(num_heads)))
    head_blocks = -(-num_heads // block_h)
    splits, _ = choose_splits(
        page_tables.shape[1] * page_size, batch * head_blocks, block_n, min_split_tokens, num_splits
    )
    kv_lens = jnp.minimum(seq_lens.astype(jnp.int32), page_tables.shape[1] * page_size)
    split_len = runtime_split_len(kv_lens, splits, block_n, min_split_len(block_n, min_split_tokens, num_splits))
    partial = (batch, splits, num_heads)
    kernel = functools.partial(
        _mla_decode_kernel,
        cache_shape=latent_cache.shape,
        num_heads=num_heads,
        block_h=block_h,
        block_n=block_n,
        scale_log2=float(sm_scale) * LOG2E,
    )
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(batch, head_blocks, splits),
        out_shape=[
            jax.ShapeDtypeStruct((*partial, rank), jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
        ],
        interpret=resolve_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name=f"mla_decode_s{page_size}_h{block_h}_n{block_n}",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        split_len,
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        q[..., :rank],
        q[..., rank:],
        cache_rows(latent_cache),
    )
    out = merge_splits(acc, m, l, axis=1)
    if return_lse:
        m_max = jnp.max(m, axis=1)
        total = jnp.sum(jnp.exp2(m - m_max[:, None]) * l, axis=1)
        lse = jnp.where(total > 0, (m_max + jnp.log2(jnp.where(total > 0, total, 1.0))) * math.log(2.0), -jnp.inf)
        return out, lse
    return out.astype(q.dtype)


def _mla_extend_kernel(
    layer_ref,
    seq_lens_ref,
    page_tables_ref,
    query_start_ref,
    mask_ref,
    q_lat_ref,
    q_rope_ref,
    rows_ref,
    out_ref,
    *,
    cache_shape,
    num_heads,
    block_h,
    block_n,
    scale_log2,
    tree,
):
    seq, i, head_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rank, rope = q_lat_ref.shape[2], q_rope_ref.shape[2]
    layer = layer_ref[0]
    start = query_start_ref[seq]
    q_len = query_start_ref[seq + 1] - start
    kv_len = jnp.minimum(seq_lens_ref[seq], page_tables_ref.shape[1] * cache_shape[2])
    prefix = kv_len - q_len
    own = i < q_len
    # Causal: keys up to the token itself; a tree may show any earlier new token, so all of them.
    hi = jnp.where(own, kv_len if tree else prefix + i + 1, 0)
    num_tiles = -(-hi // block_n)
    row = start + i

    heads = head_block * block_h + lax.iota(jnp.int32, block_h)
    real = (heads < num_heads) & own
    h2 = heads[:, None]
    dtype = rows_ref.dtype
    q_lat = pltriton.load(q_lat_ref.at[row, h2, lax.iota(jnp.int32, rank)[None, :]], mask=real[:, None], other=0)
    q_rope = pltriton.load(q_rope_ref.at[row, h2, lax.iota(jnp.int32, rope)[None, :]], mask=real[:, None], other=0)
    q_lat, q_rope = q_lat.astype(dtype), q_rope.astype(dtype)
    max_q = mask_ref.shape[1]

    def tile(t, carry):
        lo = t * block_n
        c, s = _tile_scores(
            q_lat,
            q_rope,
            rows_ref,
            page_tables_ref,
            scale_log2=scale_log2,
            cache_shape=cache_shape,
            rank=rank,
            layer=layer,
            seq=seq,
            start=lo,
            block_n=block_n,
            valid_len=hi,
        )
        j = lo + lax.iota(jnp.int32, block_n)
        visible = j < hi
        if tree:
            new = j - prefix
            in_tree = (new >= 0) & visible
            allowed = pltriton.load(
                mask_ref.at[seq, jnp.minimum(i, max_q - 1), jnp.clip(new, 0, max_q - 1)], mask=in_tree, other=0
            )
            visible = visible & ((new < 0) | (allowed != 0))
        return _online_softmax_step(carry, s, visible[None, :], c, dtype)

    m, l, acc = lax.fori_loop(0, num_tiles, tile, _empty_carry(block_h, rank))
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype)
    pltriton.store(out_ref.at[row, h2, lax.iota(jnp.int32, rank)[None, :]], out, mask=real[:, None])


@functools.partial(
    jax.jit,
    static_argnames=("kv_lora_rank", "sm_scale", "max_q_len", "interpret", "block_h", "block_n"),
)
def mla_extend(
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
    interpret=None,
    block_h=16,
    block_n=32,
):
    """mla_extend_ref's contract: q [T, Hq, R + P] (absorbed), sequence b's new tokens at rows
    query_start[b]:query_start[b+1], the last of its seq_lens[b] cached latents; causal, or
    mask [B, max_q_len, max_q_len] among the new tokens -> [T, Hq, R] in q's dtype (zeros on
    rows no sequence owns)."""
    num_rows, num_heads, width = q.shape
    _, _, page_size, one, cache_width = latent_cache.shape
    rank = kv_lora_rank
    if one != 1 or width != cache_width:
        raise ValueError(f"q {q.shape} does not fit the latent cache {latent_cache.shape}")
    for name, value in (("page_size", page_size), ("block_h", block_h), ("block_n", block_n), ("kv_lora_rank", rank)):
        check_pow2(name, value)
    check_pow2("qk_rope_head_dim", cache_width - rank)
    block_h = max(16, min(block_h, next_pow2(num_heads)))
    head_blocks = -(-num_heads // block_h)
    batch = seq_lens.shape[0]
    tree = mask is not None
    mask_arr = mask.astype(jnp.int32) if tree else jnp.zeros((batch, 1, 1), jnp.int32)
    kernel = functools.partial(
        _mla_extend_kernel,
        cache_shape=latent_cache.shape,
        num_heads=num_heads,
        block_h=block_h,
        block_n=block_n,
        scale_log2=float(sm_scale) * LOG2E,
        tree=tree,
    )
    out = pl.pallas_call(
        kernel,
        grid=(batch, max_q_len, head_blocks),
        out_shape=jax.ShapeDtypeStruct((num_rows, num_heads, rank), q.dtype),
        interpret=resolve_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        name=f"mla_extend_s{page_size}_h{block_h}_n{block_n}{'_tree' if tree else ''}",
    )(
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        query_start.astype(jnp.int32),
        mask_arr,
        q[..., :rank],
        q[..., rank:],
        cache_rows(latent_cache),
    )
    # Rows no sequence owns (padding) were never written.
    owned = jnp.arange(num_rows) < query_start[batch]
    return jnp.where(owned[:, None, None], out, 0)

"""Absorbed multi-head latent attention, Pallas over Mosaic GPU (Hopper): decode, and the extend
of a few new tokens per sequence (verify trees, causal or masked).

mla_decode.mla_decode's and mla_extend's contracts (kernels/mla_ref.py explains the absorbed form): every query
head attends to the same latent row [c (R) | k_rope (P)], the score q . row over all R + P
columns, the value c. So it is paged decode with one KV head whose keys and values are one
buffer: a program holds GROUP_ROWS query heads (the M side of both wgmmas, zero heads padding a
smaller model's), one TMA copy per page brings a tile of latent rows into swizzled shared memory,
and the values' wgmma reads a column slice of that same tile, so V costs no copy.

A program's value accumulator is GROUP_ROWS x VALUE_COLS floats in one warpgroup's registers:
a wide rank would not fit, so the rank is covered in chunks of VALUE_COLS columns, one kernel
call each (each recomputes the scores over the same tiles). Shared memory bounds the rest: the
query block, num_stages latent tiles and p (docs/kernels-mosaic.md works out DeepSeek-V3's
budget). Decode: grid (sequence, head block, context split), partials merged in jnp as in
paged_decode. Extend: grid (sequence, new token, head block), each program over the keys its
token sees, as mla_decode.mla_extend's. The pipeline's choices are paged_decode_mgpu's, for the
interpreter's sake.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.kernels.mgpu_tiles import (
    GROUP_ROWS,
    KV_DTYPES,
    MASK_WORD_BITS,
    MIN_PAGE_SIZE,
    SMEM_BYTES,
    MosaicUnsupported,
    attend_kv_tile,
    check_block_n,
    initial_rows,
    interpret_params,
    mask_word_bits,
    seen_or_in_words,
    swizzled,
)
from jspec.kernels.paged_tiles import FP8_KV_BYTES, LOG2E, choose_splits, merge_splits, min_split_len, runtime_split_len

GRID_AXES = ("seq", "head_block", "split")
EXTEND_GRID_AXES = ("seq", "token", "head_block")
# Value columns per kernel call: the accumulator's share of a thread's registers stays half.
VALUE_COLS = 256


def mla_mosaic_unsupported(cache_shape, cache_dtype, kv_lora_rank: int) -> str | None:
    """The first feature of this latent cache that the Mosaic kernel lacks, or None."""
    _, _, page_size, one, width = cache_shape
    dtype = jnp.dtype(cache_dtype)
    if dtype == FP8_KV_BYTES:
        return "an FP8 latent cache"
    if dtype not in map(jnp.dtype, KV_DTYPES):
        return f"a {dtype.name} latent cache (16-bit caches only)"
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
        return f"page size {page_size} (powers of two from {MIN_PAGE_SIZE})"
    if one != 1:
        return f"{one} latent heads (one)"
    if width % 64 or kv_lora_rank % 64 or kv_lora_rank >= width:
        # A row of a 128-byte swizzle holds 64 16-bit values: the value slice starts on one.
        return f"a latent of {width} columns with rank {kv_lora_rank} (multiples of 64)"
    if kv_lora_rank > VALUE_COLS and kv_lora_rank % VALUE_COLS:
        return f"rank {kv_lora_rank} (up to {VALUE_COLS}, or a multiple of it)"
    return None


class MosaicMLAPlan(NamedTuple):
    """Static launch settings, resolved from shapes and the tuning arguments."""

    block_n: int  # latent rows per tile: the N of the scores' wgmma, the K of the values'
    rows_per_copy: int  # rows per TMA copy: a page, or a tile of a longer page
    num_splits: int
    min_split_len: int
    num_stages: int
    value_cols: int  # value columns per kernel call
    scale_log2: float


def mla_smem_bytes(width: int, block_n: int, num_stages: int, itemsize: int = 2) -> int:
    """Shared memory of the tile loop: the query block, num_stages latent tiles, and p."""
    return itemsize * (GROUP_ROWS * width + num_stages * block_n * width + GROUP_ROWS * block_n)


def mosaic_mla_plan(
    batch,
    num_heads,
    cache_shape,
    max_pages,
    kv_lora_rank,
    *,
    sm_scale,
    block_n,
    num_splits,
    min_split_tokens,
    num_stages,
) -> MosaicMLAPlan:
    page_size, width = cache_shape[2], cache_shape[4]
    check_block_n(block_n)
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    need = mla_smem_bytes(width, block_n, num_stages)
    if need > SMEM_BYTES:
        raise ValueError(
            f"block_n {block_n} x num_stages {num_stages} at width {width} needs {need} bytes of shared memory"
        )
    head_blocks = -(-num_heads // GROUP_ROWS)
    splits, _ = choose_splits(max_pages * page_size, batch * head_blocks, block_n, min_split_tokens, num_splits)
    return MosaicMLAPlan(
        block_n,
        min(page_size, block_n),
        splits,
        min_split_len(block_n, min_split_tokens, num_splits),
        num_stages,
        min(kv_lora_rank, VALUE_COLS),
        float(sm_scale) * LOG2E,
    )


def _issue_latent_tile(
    rows_ref, page_tables_ref, tiles, barriers, *, seq, layer, start, hi, slot, plan, page_size, num_pages
):
    """TMA copies of latent rows start..start+block_n of one sequence into a slot, one per page
    (or per rows_per_copy rows of a longer page). As in mgpu_tiles.issue_kv_tile every copy is
    issued, one at or past hi reading the layer's page 0 (the caller masks it)."""
    max_pages = page_tables_ref.shape[1]
    for j in range(plan.block_n // plan.rows_per_copy):
        first = start + j * plan.rows_per_copy
        page = page_tables_ref[seq, jnp.minimum(lax.div(first, page_size), max_pages - 1)]
        row = layer * num_pages + jnp.where(first < hi, page, 0)
        offset = pl.multiple_of(lax.rem(first, page_size), plan.rows_per_copy) if page_size > plan.rows_per_copy else 0
        plgpu.copy_gmem_to_smem(
            rows_ref.at[row, pl.ds(offset, plan.rows_per_copy), 0],
            tiles.at[slot, pl.ds(j * plan.rows_per_copy, plan.rows_per_copy)],
            barriers.at[slot],
        )


def _latent_loop(
    q_ref,
    rows_ref,
    page_tables_ref,
    mask_bits_ref,
    *,
    block,
    seq,
    layer,
    lo,
    hi,
    prefix,
    plan,
    cache_shape,
    value_lo,
):
    """The online softmax (m, l, acc) of query block q_ref[block] (GROUP_ROWS heads of one token)
    over latent rows lo..hi of one sequence, the values being columns value_lo.. of each row.
    mask_bits_ref: None, or the tree masks' words [blocks, words] of each block's token over its
    sequence's new tokens, which start at prefix: key k >= prefix is seen iff bit k - prefix."""
    _, num_pages, page_size, _, width = cache_shape
    num_tiles = lax.div(jnp.maximum(hi - lo, 0) + plan.block_n - 1, plan.block_n)
    issue = functools.partial(
        _issue_latent_tile,
        rows_ref,
        page_tables_ref,
        seq=seq,
        layer=layer,
        hi=hi,
        plan=plan,
        page_size=page_size,
        num_pages=num_pages,
    )
    words = 0 if mask_bits_ref is None else mask_bits_ref.shape[1]
    # Every row of the block is the same token: its mask words are scalars, read once.
    row_words = [mask_bits_ref[block, word] for word in range(words)]

    def visible(positions):
        new_token = positions - prefix
        return seen_or_in_words(new_token < 0, new_token, [bits + jnp.zeros_like(new_token) for bits in row_words])

    def attend(q_smem, tiles, p_smem, q_barrier, barriers):
        def issue_tile(t):
            issue(tiles, barriers, start=lo + t * plan.block_n, slot=lax.rem(t, plan.num_stages))

        plgpu.copy_gmem_to_smem(q_ref.at[block], q_smem, q_barrier)
        for t in range(plan.num_stages - 1):
            pl.when(t < num_tiles)(functools.partial(issue_tile, t))
        plgpu.barrier_wait(q_barrier)

        def attend_tile(t, carry):
            slot = lax.rem(t, plan.num_stages)
            pl.when(t + plan.num_stages - 1 < num_tiles)(lambda: issue_tile(t + plan.num_stages - 1))
            plgpu.barrier_wait(barriers.at[slot])
            tile = tiles.at[slot]
            return attend_kv_tile(
                q_smem,
                tile,
                tile.at[:, pl.ds(value_lo, plan.value_cols)],
                None,  # the values arrived with the keys: one copy
                p_smem,
                carry,
                start=lo + t * plan.block_n,
                hi=hi,
                scale_log2=plan.scale_log2,
                visible=visible if words else None,
            )

        return lax.fori_loop(0, num_tiles, attend_tile, initial_rows(plan.value_cols))

    dtype = rows_ref.dtype
    return pl.run_scoped(
        attend,
        plgpu.SMEM((GROUP_ROWS, width), dtype, transforms=swizzled(width, dtype)),
        plgpu.SMEM((plan.num_stages, plan.block_n, width), dtype, transforms=swizzled(width, dtype)),
        plgpu.SMEM((GROUP_ROWS, plan.block_n), dtype, transforms=swizzled(plan.block_n, dtype)),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=plan.block_n // plan.rows_per_copy, num_barriers=plan.num_stages),
    )


def _decode_kernel(
    scalars_ref, seq_lens_ref, page_tables_ref, q_ref, rows_ref, acc_ref, m_ref, l_ref, *, num_head_blocks, **loop
):
    page_size = loop["cache_shape"][2]
    seq, head_block, split = (lax.axis_index(axis) for axis in GRID_AXES)
    layer, split_len = scalars_ref[0], scalars_ref[1]
    kv_len = jnp.minimum(seq_lens_ref[seq], page_tables_ref.shape[1] * page_size)
    lo = split * split_len
    m, l, acc = _latent_loop(
        q_ref,
        rows_ref,
        page_tables_ref,
        None,
        block=seq * num_head_blocks + head_block,
        seq=seq,
        layer=layer,
        lo=lo,
        hi=jnp.minimum(lo + split_len, kv_len),
        prefix=0,
        **loop,
    )

    def write(acc_smem, m_smem, l_smem):
        acc_smem[...] = acc
        m_smem[...] = m
        l_smem[...] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, acc_ref.at[seq, split, head_block])
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[seq, split, head_block])
        plgpu.copy_smem_to_gmem(l_smem, l_ref.at[seq, split, head_block])
        plgpu.wait_smem_to_gmem(0)

    value_cols = loop["plan"].value_cols
    pl.run_scoped(
        write,
        plgpu.SMEM((GROUP_ROWS, value_cols), jnp.float32),
        plgpu.SMEM((GROUP_ROWS,), jnp.float32),
        plgpu.SMEM((GROUP_ROWS,), jnp.float32),
    )


def _extend_kernel(
    scalars_ref,
    seq_lens_ref,
    page_tables_ref,
    query_start_ref,
    q_ref,
    rows_ref,
    *refs,
    num_head_blocks,
    max_q_len,
    tree,
    **loop,
):
    mask_bits_ref, out_ref = refs if tree else (None, *refs)
    page_size = loop["cache_shape"][2]
    seq, token, head_block = (lax.axis_index(axis) for axis in EXTEND_GRID_AXES)
    q_len = query_start_ref[seq + 1] - query_start_ref[seq]
    kv_len = jnp.minimum(seq_lens_ref[seq], page_tables_ref.shape[1] * page_size)
    prefix = kv_len - q_len
    # Causal: keys up to the token itself; a tree may show any new token, its mask says which.
    hi = jnp.where(token < q_len, kv_len if tree else prefix + token + 1, 0)
    m, l, acc = _latent_loop(
        q_ref,
        rows_ref,
        page_tables_ref,
        mask_bits_ref,
        block=(seq * max_q_len + token) * num_head_blocks + head_block,
        seq=seq,
        layer=scalars_ref[0],
        lo=0,
        hi=hi,
        prefix=prefix,
        **loop,
    )

    def write(out_smem):
        out_smem[...] = (acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])).astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[seq, token, head_block])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((GROUP_ROWS, loop["plan"].value_cols), out_ref.dtype))


def _check_call(q, latent_cache, rank: int, kernel: str) -> None:
    """q must fit the cache, and the cache be one the kernels cover (else MosaicUnsupported)."""
    if q.shape[-1] != latent_cache.shape[-1]:
        raise ValueError(f"q {q.shape} does not fit the latent cache {latent_cache.shape}")
    feature = mla_mosaic_unsupported(latent_cache.shape, latent_cache.dtype, rank)
    if feature is not None:
        raise MosaicUnsupported(feature, kernel=kernel)


def _over_value_chunks(body, inputs, *, plan, rank, out_type, grid, grid_names, interpret, name, **statics):
    """One kernel call per chunk of plan.value_cols value columns (each recomputes the same
    scores): their outputs, in column order."""
    outs = []
    for value_lo in range(0, rank, plan.value_cols):
        kernel = plgpu.kernel(
            functools.partial(body, plan=plan, value_lo=value_lo, **statics),
            out_type=out_type,
            grid=grid,
            grid_names=grid_names,
            interpret=interpret_params(interpret),
            kernel_name=f"{name}_v{value_lo}",
        )
        outs.append(kernel(*inputs))
    return outs


@functools.partial(
    jax.jit,
    static_argnames=(
        "kv_lora_rank",
        "sm_scale",
        "interpret",
        "block_n",
        "num_splits",
        "min_split_tokens",
        "num_stages",
        "return_lse",
    ),
)
def mla_decode_mgpu(
    q,
    latent_cache,
    layer,
    seq_lens,
    page_tables,
    *,
    kv_lora_rank,
    sm_scale,
    interpret=None,
    block_n=64,
    num_splits=None,
    min_split_tokens=256,
    num_stages=2,
    return_lse=False,
):
    """mla_decode.mla_decode on Mosaic GPU: the same arguments and results (q [B, Hq, R + P],
    latent_cache [L, pages, S, 1, R + P] -> [B, Hq, R]; with return_lse (out f32, lse [B, Hq])).

    Raises MosaicUnsupported for what mla_mosaic_unsupported() names. Tuning: block_n latent
    rows per tile (64, 128 or 256, as shared memory allows at this width); num_splits and
    min_split_tokens as the Triton kernel's; num_stages tiles in flight. interpret: as
    paged_decode_mgpu's."""
    batch, num_heads, width = q.shape
    num_layers, num_pages, page_size, _, _ = latent_cache.shape
    rank = kv_lora_rank
    _check_call(q, latent_cache, rank, "MLA decode")
    plan = mosaic_mla_plan(
        batch,
        num_heads,
        latent_cache.shape,
        page_tables.shape[1],
        rank,
        sm_scale=sm_scale,
        block_n=block_n,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
        num_stages=num_stages,
    )
    head_blocks = -(-num_heads // GROUP_ROWS)
    kv_lens = jnp.minimum(seq_lens.astype(jnp.int32), page_tables.shape[1] * page_size)
    split_len = runtime_split_len(kv_lens, plan.num_splits, plan.block_n, plan.min_split_len)
    # wgmma's 64 rows: each block of heads, the last one padded with zero heads.
    q_blocks = jnp.pad(q.astype(latent_cache.dtype), ((0, 0), (0, head_blocks * GROUP_ROWS - num_heads), (0, 0)))
    q_blocks = q_blocks.reshape(batch * head_blocks, GROUP_ROWS, width)
    partial = (batch, plan.num_splits, head_blocks, GROUP_ROWS)
    out_type = (
        jax.ShapeDtypeStruct((*partial, plan.value_cols), jnp.float32),
        jax.ShapeDtypeStruct(partial, jnp.float32),
        jax.ShapeDtypeStruct(partial, jnp.float32),
    )
    args = (
        jnp.stack([jnp.reshape(layer, ()).astype(jnp.int32), split_len[0]]),
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        q_blocks,
        latent_cache.reshape(num_layers * num_pages, page_size, 1, width),  # layer and page in one index
    )
    chunks = _over_value_chunks(
        _decode_kernel,
        args,
        plan=plan,
        rank=rank,
        out_type=out_type,
        grid=(batch, head_blocks, plan.num_splits),
        grid_names=GRID_AXES,
        interpret=interpret,
        name=f"mla_decode_mgpu_s{page_size}_n{plan.block_n}",
        cache_shape=latent_cache.shape,
        num_head_blocks=head_blocks,
    )
    # Every chunk's scores are the same: m and l from the first; the values side by side.
    acc = jnp.concatenate([c[0] for c in chunks], axis=-1)
    m, l = chunks[0][1], chunks[0][2]
    acc, m, l = (
        x.reshape(batch, plan.num_splits, head_blocks * GROUP_ROWS, *x.shape[4:])[:, :, :num_heads] for x in (acc, m, l)
    )
    out = merge_splits(acc, m, l, axis=1)
    if return_lse:
        m_max = jnp.max(m, axis=1)
        total = jnp.sum(jnp.exp2(m - m_max[:, None]) * l, axis=1)
        lse = jnp.where(total > 0, (m_max + jnp.log2(jnp.where(total > 0, total, 1.0))) * math.log(2.0), -jnp.inf)
        return out, lse
    return out.astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("kv_lora_rank", "sm_scale", "max_q_len", "interpret", "block_n", "num_stages"),
)
def mla_extend_mgpu(
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
    block_n=64,
    num_stages=2,
):
    """mla_decode.mla_extend on Mosaic GPU: the same arguments and result (q [T, Hq, R + P],
    sequence b's new tokens at rows query_start[b]:query_start[b+1], the last of its seq_lens[b]
    cached latents; causal, or mask [B, max_q_len, max_q_len] among the new tokens -> [T, Hq, R]
    in q's dtype, zeros on rows no sequence owns). One program per (sequence, new token, head
    block) over the keys that token sees, as the Triton kernel's: right for verify trees of a few
    nodes. Raises MosaicUnsupported for what mla_mosaic_unsupported() names."""
    num_rows, num_heads, width = q.shape
    num_layers, num_pages, page_size, _, _ = latent_cache.shape
    rank = kv_lora_rank
    _check_call(q, latent_cache, rank, "MLA extend")
    batch = seq_lens.shape[0]
    tree = mask is not None
    words = -(-max_q_len // MASK_WORD_BITS) if tree else 0
    # One split: a verify token's keys are read once per head block and value chunk.
    plan = mosaic_mla_plan(
        batch,
        num_heads,
        latent_cache.shape,
        page_tables.shape[1],
        rank,
        sm_scale=sm_scale,
        block_n=block_n,
        num_splits=1,
        min_split_tokens=256,
        num_stages=num_stages,
    )
    head_blocks = -(-num_heads // GROUP_ROWS)
    # Each sequence's new tokens gathered to [B, max_q_len] (zeros past its own), then blocks of
    # GROUP_ROWS heads, the last padded with zero heads.
    query_start = query_start.astype(jnp.int32)
    token = jnp.arange(max_q_len, dtype=jnp.int32)
    q_lens = query_start[1:] - query_start[:-1]
    owned = token[None] < q_lens[:, None]  # [B, max_q_len]
    rows = jnp.clip(query_start[:-1, None] + token[None], 0, num_rows - 1)
    gathered = jnp.where(owned[..., None, None], q[rows], 0).astype(latent_cache.dtype)
    gathered = jnp.pad(gathered, ((0, 0), (0, 0), (0, head_blocks * GROUP_ROWS - num_heads), (0, 0)))
    q_blocks = gathered.reshape(batch * max_q_len * head_blocks, GROUP_ROWS, width)
    inputs = [
        jnp.reshape(layer, (1,)).astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        query_start,
        q_blocks,
        latent_cache.reshape(num_layers * num_pages, page_size, 1, width),
    ]
    if tree:
        # Each token's row of the mask as bits, for each of its head blocks:
        # [B * max_q_len * head_blocks, words].
        bits = mask_word_bits(mask, words)  # [B, max_q_len, words]
        bits = jnp.broadcast_to(bits[:, :, None, :], (batch, max_q_len, head_blocks, words))
        inputs.append(bits.reshape(-1, words))
    chunks = _over_value_chunks(
        _extend_kernel,
        inputs,
        plan=plan,
        rank=rank,
        out_type=jax.ShapeDtypeStruct((batch, max_q_len, head_blocks, GROUP_ROWS, plan.value_cols), q.dtype),
        grid=(batch, max_q_len, head_blocks),
        grid_names=EXTEND_GRID_AXES,
        interpret=interpret,
        name=f"mla_extend_mgpu_s{page_size}_n{plan.block_n}{'_tree' if tree else ''}",
        cache_shape=latent_cache.shape,
        num_head_blocks=head_blocks,
        max_q_len=max_q_len,
        tree=tree,
    )
    out = jnp.concatenate(chunks, axis=-1).reshape(batch, max_q_len, head_blocks * GROUP_ROWS, rank)[:, :, :num_heads]
    # Back to the rows: row r is token r - query_start[b] of the sequence b that owns it.
    r = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start, r, side="right") - 1, 0, batch - 1)
    within = jnp.clip(r - query_start[seq], 0, max_q_len - 1)
    return jnp.where((r < query_start[batch])[:, None, None], out[seq, within], 0)

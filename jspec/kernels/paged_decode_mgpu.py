"""Paged attention for decode: one query token per sequence, Pallas over Mosaic GPU (Hopper).

The same contract as paged_decode.paged_decode (same arguments, same outputs, the same split-K
plan and merge; sliding windows, soft-caps and sinks included), for 16-bit and FP8 KV pools
(an FP8 tile upcast to f16 in shared memory before its wgmmas) and pages of 8 or more tokens.
Anything else raises MosaicUnsupported, naming the feature, so that a caller can fall back to the
Triton-backend kernel; mosaic_decode_unsupported() asks first.

Grid (sequence, kv head, context split), one warpgroup per program. The program's GQA group is
the M side of two wgmmas (logits = q k^T, then p v), padded with zero rows to wgmma's 64: the
padding is copied once per call in jnp, since a TMA box into a tiled buffer must start on a
tile, which a group's first head does not. KV moves by TMA, one copy per page (per tile, for
pages longer than a tile) into swizzled shared memory, num_stages tiles in flight: the copies
of tile t + num_stages - 1 are issued before tile t is computed.

A sliding window moves the splits to cover the last window tokens only, from the tile holding
the window's first key (a TMA copy starts on a tile), whose earlier keys are masked. Sinks enter
as the first split's initial state (as paged_tiles.with_sink), so the merge counts them once.

What the Mosaic GPU interpreter (the CPU test path) can run shapes three choices, each of
which a faster kernel would make differently (docs/kernels-mosaic.md):
- every tile issues all its page copies, a page past the sequence's end reading the layer's
  page 0: a predicated copy would skip it, but the interpreter cannot run one. Keys past the
  end are masked, values there zeroed in shared memory (a NaN would survive a zero weight);
- p goes through shared memory into the second wgmma: a register operand is not interpreted;
- each tile's p v lands in a fresh accumulator, added to the running one in registers:
  accumulating into it (pl.run_state over plgpu.ACC.init) is not interpreted.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.kernels.mgpu_tiles import (
    GROUP_ROWS,
    SMEM_BYTES,
    MosaicUnsupported,
    attend_kv_tile,
    check_block_n,
    initial_rows,
    interpret_params,
    issue_kv_tile,
    paged_unsupported,
    rows_after_sinks,
    split_sink_rows,
    swizzled,
    tile_smem_bytes,
    upcast_kv_tiles,
    upcast_tiles_smem,
    wgmma_dtype,
)
from jspec.kernels.paged_tiles import (
    LOG2E,
    choose_splits,
    lse_of_splits,
    merge_splits,
    min_split_len,
    runtime_split_len,
    window_scalar,
)

GRID_AXES = ("seq", "kv_head", "split")


def mosaic_decode_unsupported(cache_shape, cache_dtype, num_q_heads, *, num_warps=4) -> str | None:
    """The first feature of this call that the Mosaic kernel lacks, or None if it can run it."""
    return paged_unsupported(cache_shape, cache_dtype, num_q_heads, num_warps=num_warps)


def _attend_split(
    scalars_ref,
    seq_lens_ref,
    page_tables_ref,
    q_ref,
    k_ref,
    v_ref,
    sinks_ref,
    q_smem,
    k_smem,
    v_smem,
    p_smem,
    sink_smem,
    q_barrier,
    k_barriers,
    v_barriers,
    *upcast,
    page_size,
    num_pages,
    num_kv_heads,
    group,
    block_n,
    rows_per_copy,
    num_stages,
    scale_log2,
    softcap,
):
    """This program's split of the context: its online-softmax state (m, l, acc) over GROUP_ROWS rows.
    upcast: over an FP8 pool, the 16-bit K and V tiles each byte tile is written to before its
    wgmmas (empty otherwise)."""
    seq, kv_head, split = (lax.axis_index(axis) for axis in GRID_AXES)
    max_pages = page_tables_ref.shape[1]
    head_dim = q_smem.shape[1]
    layer, split_len, window = scalars_ref[0], scalars_ref[1], scalars_ref[2]
    kv_len = jnp.minimum(seq_lens_ref[seq], max_pages * page_size)
    # The query sits at kv_len - 1: keys before kv_len - window are out of its window. The
    # splits start on the tile holding the first key in it.
    window_lo = jnp.maximum(kv_len - window, 0)
    lo = lax.div(window_lo, block_n) * block_n + split * split_len
    hi = jnp.minimum(lo + split_len, kv_len)
    num_tiles = lax.div(jnp.maximum(hi - lo, 0) + block_n - 1, block_n)

    def issue_tile(t):
        issue_kv_tile(
            k_ref,
            v_ref,
            page_tables_ref,
            k_smem,
            v_smem,
            k_barriers,
            v_barriers,
            seq=seq,
            kv_head=kv_head,
            layer=layer,
            start=lo + t * block_n,
            hi=hi,
            slot=lax.rem(t, num_stages),
            page_size=page_size,
            num_pages=num_pages,
            block_n=block_n,
            rows_per_copy=rows_per_copy,
        )

    plgpu.copy_gmem_to_smem(q_ref.at[seq * num_kv_heads + kv_head], q_smem, q_barrier)
    if sinks_ref is not None:
        plgpu.copy_gmem_to_smem(sinks_ref.at[split, kv_head], sink_smem, q_barrier)
    for t in range(num_stages - 1):
        pl.when(t < num_tiles)(functools.partial(issue_tile, t))
    plgpu.barrier_wait(q_barrier)
    carry = initial_rows(head_dim) if sinks_ref is None else rows_after_sinks(sink_smem, head_dim)

    def attend_tile(t, carry):
        slot = lax.rem(t, num_stages)
        pl.when(t + num_stages - 1 < num_tiles)(lambda: issue_tile(t + num_stages - 1))
        plgpu.barrier_wait(k_barriers.at[slot])
        k_tile, v_tile, v_barrier = k_smem.at[slot], v_smem.at[slot], v_barriers.at[slot]
        if upcast:
            k_tile, v_tile, v_barrier = (*upcast_kv_tiles(k_tile, v_tile, v_barrier, *upcast), None)
        return attend_kv_tile(
            q_smem,
            k_tile,
            v_tile,
            v_barrier,
            p_smem,
            carry,
            start=lo + t * block_n,
            hi=hi,
            scale_log2=scale_log2,
            lo=window_lo,
            softcap=softcap,
        )

    return lax.fori_loop(0, num_tiles, attend_tile, carry)


def _write_out(out_ref, out_smem, m, l, acc, *, group):
    seq, kv_head = lax.axis_index("seq"), lax.axis_index("kv_head")
    out_smem[...] = (acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])).astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, group)], out_ref.at[seq, pl.ds(kv_head * group, group)])
    plgpu.wait_smem_to_gmem(0)


def _write_partials(acc_ref, m_ref, l_ref, acc_smem, m_smem, l_smem, m, l, acc, *, group):
    seq, kv_head, split = (lax.axis_index(axis) for axis in GRID_AXES)
    acc_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem.at[pl.ds(0, group)], acc_ref.at[seq, split, pl.ds(kv_head * group, group)])
    # m and l go out whole (GROUP_ROWS floats, padding rows too): a TMA row must be 16-byte multiple.
    plgpu.copy_smem_to_gmem(m_smem, m_ref.at[seq, split, kv_head])
    plgpu.copy_smem_to_gmem(l_smem, l_ref.at[seq, split, kv_head])
    plgpu.wait_smem_to_gmem(0)


def _decode_kernel(
    scalars_ref, seq_lens_ref, page_tables_ref, q_ref, k_ref, v_ref, *refs, plan, cache_shape, group, softcap, sinks
):
    sinks_ref, *out_refs = refs if sinks else (None, *refs)
    _, num_pages, page_size, num_kv_heads, head_dim = cache_shape
    dtype = wgmma_dtype(k_ref.dtype)
    stages, block_n = plan.num_stages, plan.block_n
    attend = functools.partial(
        _attend_split,
        scalars_ref,
        seq_lens_ref,
        page_tables_ref,
        q_ref,
        k_ref,
        v_ref,
        sinks_ref,
        page_size=page_size,
        num_pages=num_pages,
        num_kv_heads=num_kv_heads,
        group=group,
        block_n=block_n,
        rows_per_copy=plan.rows_per_copy,
        num_stages=stages,
        scale_log2=plan.scale_log2,
        softcap=softcap,
    )
    copies = block_n // plan.rows_per_copy
    # Two scopes, one after the other: the epilogue's buffers reuse the tiles' shared memory.
    kv = k_ref.dtype
    scratch = [
        plgpu.SMEM((GROUP_ROWS, head_dim), dtype, transforms=swizzled(head_dim, dtype)),
        plgpu.SMEM((stages, block_n, head_dim), kv, transforms=swizzled(head_dim, kv)),
        plgpu.SMEM((stages, block_n, head_dim), kv, transforms=swizzled(head_dim, kv)),
        plgpu.SMEM((GROUP_ROWS, block_n), dtype, transforms=swizzled(block_n, dtype)),
        plgpu.SMEM((GROUP_ROWS,), jnp.float32),  # the rows' sinks (unused without)
        plgpu.Barrier(num_arrivals=2 if sinks else 1),  # q, and the sinks
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
    ]
    scratch += upcast_tiles_smem(block_n, head_dim, kv)
    m, l, acc = pl.run_scoped(attend, *scratch)
    if len(out_refs) == 1:
        (out_ref,) = out_refs
        write = functools.partial(_write_out, out_ref, group=group)
        pl.run_scoped(lambda out_smem: write(out_smem, m, l, acc), plgpu.SMEM((GROUP_ROWS, head_dim), out_ref.dtype))
    else:
        write = functools.partial(_write_partials, *out_refs, group=group)
        pl.run_scoped(
            lambda *smem: write(*smem, m, l, acc),
            plgpu.SMEM((GROUP_ROWS, head_dim), jnp.float32),
            plgpu.SMEM((GROUP_ROWS,), jnp.float32),
            plgpu.SMEM((GROUP_ROWS,), jnp.float32),
        )


class MosaicDecodePlan(NamedTuple):
    """Static launch settings, resolved from shapes and the tuning arguments."""

    block_n: int  # KV tokens per tile: the N of the logits wgmma, the K of the values one
    rows_per_copy: int  # tokens per TMA copy: a page, or a tile of a longer page
    num_splits: int
    min_split_len: int  # floor of the runtime KV tokens per split, a multiple of block_n
    num_stages: int  # KV tiles in shared memory at once
    scale_log2: float


def mosaic_decode_plan(
    batch,
    num_q_heads,
    cache_shape,
    max_pages,
    *,
    sm_scale,
    block_n=None,
    num_splits=None,
    min_split_tokens=256,
    num_stages=2,
    cache_dtype=jnp.bfloat16,
) -> MosaicDecodePlan:
    _, _, page_size, _, head_dim = cache_shape
    block_n = block_n or 64
    check_block_n(block_n)
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    tiles = tile_smem_bytes(head_dim, block_n, num_stages, cache_dtype)
    if tiles > SMEM_BYTES:
        raise ValueError(
            f"block_n {block_n} x num_stages {num_stages} at head_dim {head_dim} needs {tiles} bytes of shared memory"
        )
    splits, _ = choose_splits(max_pages * page_size, batch * cache_shape[3], block_n, min_split_tokens, num_splits)
    return MosaicDecodePlan(
        block_n,
        min(page_size, block_n),
        splits,
        min_split_len(block_n, min_split_tokens, num_splits),
        num_stages,
        float(sm_scale) * LOG2E,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "logit_softcap",
        "interpret",
        "block_n",
        "num_splits",
        "min_split_tokens",
        "num_warps",
        "num_stages",
        "return_lse",
    ),
)
def paged_decode_mgpu(
    q,
    k_cache,
    v_cache,
    layer,
    seq_lens,
    page_tables,
    *,
    sm_scale,
    interpret=None,
    block_n=None,
    num_splits=None,
    min_split_tokens=256,
    num_warps=4,
    num_stages=2,
    return_lse=False,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """paged_decode.paged_decode on Mosaic GPU: the same arguments and results (see there).

    Raises MosaicUnsupported for what mosaic_decode_unsupported() names. Tuning: block_n KV
    tokens per tile (64, 128 or 256); num_splits and min_split_tokens as the Triton
    kernel's; num_stages KV tiles in flight; num_warps must be 4 (one warpgroup). interpret:
    None runs the Mosaic GPU interpreter off the GPU, as the other kernels run theirs; an
    InterpretGPUParams runs it with those settings (its race detector, say).
    """
    batch, num_q_heads, head_dim = q.shape
    num_layers, num_pages, page_size, num_kv_heads, _ = k_cache.shape
    if k_cache.shape[4] != head_dim or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q {q.shape} does not fit the caches {k_cache.shape}, {v_cache.shape}")
    feature = mosaic_decode_unsupported(k_cache.shape, k_cache.dtype, num_q_heads, num_warps=num_warps)
    if feature is not None:
        raise MosaicUnsupported(feature)
    plan = mosaic_decode_plan(
        batch,
        num_q_heads,
        k_cache.shape,
        page_tables.shape[1],
        sm_scale=sm_scale,
        block_n=block_n,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
        num_stages=num_stages,
        cache_dtype=k_cache.dtype,
    )
    group = num_q_heads // num_kv_heads
    write_final = plan.num_splits == 1 and not return_lse
    kv_lens = jnp.minimum(seq_lens.astype(jnp.int32), page_tables.shape[1] * page_size)
    window = window_scalar(window)
    # The splits cover a window from the tile holding its first key: up to block_n - 1 more.
    span = jnp.minimum(kv_lens, window + (plan.block_n - 1))
    split_len = runtime_split_len(span, plan.num_splits, plan.block_n, plan.min_split_len)
    # wgmma's 64 rows: the group's heads, then zeros.
    q_groups = q.astype(wgmma_dtype(k_cache.dtype)).reshape(batch * num_kv_heads, group, head_dim)
    q_groups = jnp.pad(q_groups, ((0, 0), (0, GROUP_ROWS - group), (0, 0)))
    if write_final:
        out_type = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        partial = (batch, plan.num_splits)
        out_type = (
            jax.ShapeDtypeStruct((*partial, num_q_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((*partial, num_kv_heads, GROUP_ROWS), jnp.float32),
            jax.ShapeDtypeStruct((*partial, num_kv_heads, GROUP_ROWS), jnp.float32),
        )
    softcap = None if logit_softcap is None else float(logit_softcap)
    kernel = plgpu.kernel(
        functools.partial(
            _decode_kernel, plan=plan, cache_shape=k_cache.shape, group=group, softcap=softcap, sinks=sinks is not None
        ),
        out_type=out_type,
        grid=(batch, num_kv_heads, plan.num_splits),
        grid_names=GRID_AXES,
        interpret=interpret_params(interpret),
        kernel_name=f"paged_decode_mgpu_s{page_size}_g{group}_n{plan.block_n}",
    )
    extra = ()
    if sinks is not None:
        # Each kv head's group of sinks, padded to the block's rows (a TMA box starts on a row).
        sink_rows = jnp.pad(sinks.reshape(num_kv_heads, group), ((0, 0), (0, GROUP_ROWS - group)))
        extra = (split_sink_rows(sink_rows, plan.num_splits),)
    pages = (num_layers * num_pages, page_size, num_kv_heads, head_dim)  # a free reshape: layer and page in one index
    outs = kernel(
        jnp.stack([jnp.reshape(layer, ()).astype(jnp.int32), split_len[0], window]),
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        q_groups,
        k_cache.reshape(pages),
        v_cache.reshape(pages),
        *extra,
    )
    if write_final:
        return outs
    acc, m, l = outs
    m, l = (x[..., :group].reshape(batch, plan.num_splits, num_q_heads) for x in (m, l))
    if return_lse:
        return merge_splits(acc, m, l, axis=1), lse_of_splits(m, l, axis=1)
    return merge_splits(acc, m, l, axis=1).astype(q.dtype)

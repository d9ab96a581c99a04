"""Skinny matmul x[M, K] @ W[K, N] for decode rows (M <= 64), Pallas over Mosaic GPU (Hopper).

The same contract as skinny_matmul.skinny_matmul for 16-bit weights, and FP8 (e4m3) ones with
one scale row or block scales whose blocks hold whole K tiles, K and N whole tiles; anything
else raises MosaicUnsupported, naming it, so that a caller can fall back to the Triton-backend
kernel; mosaic_skinny_unsupported() asks first.

Grid (column strip, K split), one warpgroup per program. Every weight byte is read once: the
program walks its strip's block_n columns down its split of K in block_k-row tiles, each tile of
W and the matching tile of x moved by TMA into swizzled shared memory, num_stages tiles in
flight (the copies of tile t + num_stages - 1 are issued before tile t is multiplied). x is
padded to wgmma's 64 rows once per call in jnp; only the M real rows of each split's f32
partial are written, and the splits are summed in jnp, where XLA fuses the sum into what follows.

As in the paged kernels (paged_decode_mgpu.py), each tile's product lands in a fresh
accumulator that is added to the running one in registers: accumulating in place is not run by
Mosaic GPU's interpreter, the CPU test path.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.kernels.mgpu_tiles import GROUP_ROWS, SMEM_BYTES, MosaicUnsupported, interpret_params, swizzled
from jspec.kernels.paged_tiles import TARGET_PROGRAMS

MAX_ROWS = GROUP_ROWS  # wgmma's M: the padded x tile
WEIGHT_DTYPES = (jnp.bfloat16, jnp.float16)
# An FP8 weight's tiles are upcast to this in shared memory for wgmma (through f32: Hopper has
# no direct e4m3 -> bf16), x cast to it too; bf16 keeps x's range where f16 would not.
FP8_WEIGHT, FP8_COMPUTE = jnp.float8_e4m3fn, jnp.bfloat16
# A K tile is one 128-byte swizzle row of 16-bit x; block_n is wgmma's N.
BLOCK_K = 64
BLOCK_N_CHOICES = (64, 128, 256)
GRID_AXES = ("strip", "split")
# As skinny_matmul's: a split shorter than this many tiles spends its time filling the pipeline.
MIN_TILES_PER_SPLIT = 4


def mosaic_skinny_unsupported(
    M: int, K: int, N: int, w_dtype, *, block_n: int | None = None, scale_rows: int = 1
) -> str | None:
    """The first feature of this call that the Mosaic kernel lacks, or None if it can run it
    (block_n None: the plan's, which takes any N that 64 divides; scale_rows: an FP8 weight's
    scale rows: one per tensor or per output channel, several for block scales)."""
    dtype = jnp.dtype(w_dtype)
    if dtype == jnp.dtype(FP8_WEIGHT):
        if scale_rows > 1 and (K % scale_rows or (K // scale_rows) % BLOCK_K):
            return f"FP8 block scales of {K}/{scale_rows} rows (blocks of whole {BLOCK_K}-row tiles)"
    elif dtype not in map(jnp.dtype, WEIGHT_DTYPES):
        return f"{dtype.name} weights (16-bit or FP8 e4m3 weights only)"
    if not 1 <= M <= MAX_ROWS:
        return f"{M} rows (1 to {MAX_ROWS})"
    if K % BLOCK_K:
        return f"K {K} (a multiple of {BLOCK_K})"
    if N % (block_n or BLOCK_N_CHOICES[0]):
        return f"N {N} (a multiple of block_n {block_n or BLOCK_N_CHOICES[0]})"
    return None


class MosaicSkinnyPlan(NamedTuple):
    """Static launch settings, resolved from the shape and the tuning arguments."""

    block_n: int  # weight columns per program: wgmma's N
    num_splits: int  # K partitions, each of tiles_per_split tiles
    tiles_per_split: int
    num_stages: int  # tiles of x and W in shared memory at once


def mosaic_skinny_plan(
    K: int, N: int, *, block_n=None, num_splits=None, num_stages=4, w_itemsize: int = 2
) -> MosaicSkinnyPlan:
    """Default tiles and split-K: block_n 128 (64 for an N that 128 does not divide, as SmolLM2's
    fused QKV), and enough K splits (a divisor of K's tiles, no
    split under MIN_TILES_PER_SPLIT tiles) that the grid reaches TARGET_PROGRAMS programs when the
    strips alone do not."""
    block_n = block_n or (128 if N % 128 == 0 else 64)
    if block_n not in BLOCK_N_CHOICES:
        raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES}, got {block_n}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    smem = num_stages * (2 * MAX_ROWS * BLOCK_K + w_itemsize * BLOCK_K * block_n) + 4 * MAX_ROWS * block_n
    if w_itemsize == 1:  # the upcast tile, and each stage's row of block scales
        smem += 2 * BLOCK_K * block_n + num_stages * 4 * block_n
    if smem > SMEM_BYTES:
        raise ValueError(f"block_n {block_n} x num_stages {num_stages} needs {smem} bytes of shared memory")
    strips, k_tiles = N // block_n, K // BLOCK_K
    if num_splits is None:
        wanted = max(1, -(-TARGET_PROGRAMS // strips))
        # Every split runs the same static trip count: the largest divisor of the tile count
        # that is at most what the grid wants and keeps splits long enough.
        num_splits = max(
            d
            for d in range(1, k_tiles + 1)
            if k_tiles % d == 0 and d <= wanted and (d == 1 or k_tiles // d >= MIN_TILES_PER_SPLIT)
        )
    if k_tiles % num_splits:
        raise ValueError(f"num_splits {num_splits} must divide K's {k_tiles} tiles of {BLOCK_K}")
    return MosaicSkinnyPlan(block_n, num_splits, k_tiles // num_splits, num_stages)


def _skinny_kernel(x_ref, w_ref, *refs, plan, rows, dtype, tiles_per_block):
    """dtype: the wgmma's (x's tiles, and an FP8 weight's upcast ones). tiles_per_block: K tiles
    per scale row of an FP8 weight with block scales (refs then start with the scale [rows, N]),
    else 0: each tile's product is multiplied by its block's scale row before it is summed."""
    (scale_ref, out_ref) = refs if tiles_per_block else (None, *refs)
    block_n, stages, tiles = plan.block_n, plan.num_stages, plan.tiles_per_split
    strip, split = (lax.axis_index(axis) for axis in GRID_AXES)
    cols = pl.ds(pl.multiple_of(strip * block_n, block_n), block_n)
    first_tile = split * tiles

    fp8 = w_ref.dtype == FP8_WEIGHT

    def product(x_smem, w_smem, barriers, w_16=None, scale_smem=None):
        def issue(t):
            slot = lax.rem(t, stages)
            k = pl.ds(pl.multiple_of((first_tile + t) * BLOCK_K, BLOCK_K), BLOCK_K)
            plgpu.copy_gmem_to_smem(x_ref.at[:, k], x_smem.at[slot], barriers.at[slot])
            plgpu.copy_gmem_to_smem(w_ref.at[k, cols], w_smem.at[slot], barriers.at[slot])
            if tiles_per_block:
                block = pl.ds(lax.div(first_tile + t, tiles_per_block), 1)
                plgpu.copy_gmem_to_smem(scale_ref.at[block, cols], scale_smem.at[slot], barriers.at[slot])

        for t in range(min(stages - 1, tiles)):
            issue(t)

        def tile(t, acc):
            slot = lax.rem(t, stages)
            # The slot refilled here held tile t - 1, whose wgmma has been read out already.
            pl.when(t + stages - 1 < tiles)(lambda: issue(t + stages - 1))
            plgpu.barrier_wait(barriers.at[slot])

            if tiles_per_block:  # read before the wgmma, as the tile's upcast is
                scale = plgpu.load(scale_smem.at[slot].at[0], layout=plgpu.Layout.WGMMA.reduce(0))
            w_tile = w_smem.at[slot]
            if fp8:  # the previous tile's wgmma, read out already, is done with w_16
                w_16[...] = w_tile[...].astype(jnp.float32).astype(dtype)
                plgpu.commit_smem()
                w_tile = w_16

            def multiply(acc_ref):
                plgpu.wgmma(acc_ref, x_smem.at[slot], w_tile)
                return acc_ref[...]

            tile_product = pl.run_scoped(multiply, plgpu.ACC((MAX_ROWS, block_n), jnp.float32))
            if tiles_per_block:
                tile_product = tile_product * scale[None, :]
            return acc + tile_product

        zeros = plgpu.layout_cast(jnp.zeros((MAX_ROWS, block_n), jnp.float32), plgpu.Layout.WGMMA)
        return lax.fori_loop(0, tiles, tile, zeros)

    w_dtype = w_ref.dtype
    scratch = [
        plgpu.SMEM((stages, MAX_ROWS, BLOCK_K), dtype, transforms=swizzled(BLOCK_K, dtype)),
        plgpu.SMEM((stages, BLOCK_K, block_n), w_dtype, transforms=swizzled(block_n, w_dtype)),
        plgpu.Barrier(num_arrivals=3 if tiles_per_block else 2, num_barriers=stages),
    ]
    if fp8:
        scratch.append(plgpu.SMEM((BLOCK_K, block_n), dtype, transforms=swizzled(block_n, dtype)))
    if tiles_per_block:
        scratch.append(plgpu.SMEM((stages, 1, block_n), jnp.float32))
    acc = pl.run_scoped(product, *scratch)

    def write(out_smem):
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, rows)], out_ref.at[split, :, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((MAX_ROWS, block_n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_n", "num_splits", "num_stages", "interpret"))
def skinny_matmul_mgpu(x, w, scale=None, *, block_n=None, num_splits=None, num_stages=4, interpret=None):
    """skinny_matmul.skinny_matmul on Mosaic GPU: x [M, K] (M <= 64, any float dtype) @ w [K, N]
    (16-bit) -> f32 [M, N], x cast to w's dtype, f32 accumulation. An FP8 (e4m3) w comes with
    scale [rows, N] f32: its tiles are upcast to bf16 in shared memory, x cast to bf16; one row
    (per tensor or per output channel) multiplies the f32 sum after the kernel, several (block
    scales, each over K / rows input rows) each tile's product inside it.

    Raises MosaicUnsupported for what mosaic_skinny_unsupported() names. Tuning (see
    mosaic_skinny_plan): block_n (64, 128 or 256), num_splits (a divisor of K / 64), num_stages.
    interpret: as the other kernels' (an InterpretGPUParams runs the interpreter with its settings).
    """
    (M, K), (K_w, N) = x.shape, w.shape
    if K != K_w:
        raise ValueError(f"x {x.shape} does not fit w {w.shape}")
    fp8 = w.dtype == FP8_WEIGHT
    if fp8 != (scale is not None):
        raise ValueError("an FP8 weight needs its scale, and only an FP8 weight takes one")
    feature = mosaic_skinny_unsupported(
        M, K, N, w.dtype, block_n=block_n, scale_rows=1 if scale is None else scale.shape[0]
    )
    if feature is not None:
        raise MosaicUnsupported(feature, kernel="skinny matmul")
    plan = mosaic_skinny_plan(
        K, N, block_n=block_n, num_splits=num_splits, num_stages=num_stages, w_itemsize=w.dtype.itemsize
    )
    dtype = FP8_COMPUTE if fp8 else w.dtype
    x_rows = jnp.pad(x.astype(dtype), ((0, MAX_ROWS - M), (0, 0)))  # wgmma's 64 rows
    in_blocks = 1 if scale is None else scale.shape[0]
    tiles_per_block = K // in_blocks // BLOCK_K if in_blocks > 1 else 0
    kernel = plgpu.kernel(
        functools.partial(_skinny_kernel, plan=plan, rows=M, dtype=dtype, tiles_per_block=tiles_per_block),
        out_type=jax.ShapeDtypeStruct((plan.num_splits, M, N), jnp.float32),
        grid=(N // plan.block_n, plan.num_splits),
        grid_names=GRID_AXES,
        interpret=interpret_params(interpret),
        kernel_name=f"skinny_matmul_mgpu_n{plan.block_n}_s{plan.num_splits}",
    )
    partials = kernel(x_rows, w, scale) if tiles_per_block else kernel(x_rows, w)
    out = partials[0] if plan.num_splits == 1 else jnp.sum(partials, axis=0)
    return out if scale is None or tiles_per_block else out * scale[0]

"""Skinny matmul x[M, K] @ W[K, N] for decode rows (M <= 16), Pallas over Triton; W in the
model's dtype, or FP8 (e4m3) with f32 scales, upcast in registers after the load.

Every weight byte is read once, with as many bytes in flight as the SMs hold: program (j, s)
walks the block_n columns of strip j over split s of K in block_k tiles (x padded to 16 rows,
Triton's smallest dot); the splits' f32 partials are summed in jnp, where XLA fuses the sum
into what follows. W is row-major [K, N], jspec's layout, so tile rows are contiguous.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.kernels.backend import resolve_interpret
from jspec.kernels.paged_tiles import TARGET_PROGRAMS, check_pow2, next_pow2

# Triton's tl.dot needs every dimension >= 16, so x is padded to 16 rows and no
# tile is narrower than 16.
DOT_ROWS = 16
MAX_ROWS = DOT_ROWS
# A split shorter than this many K tiles leaves the software pipeline (num_stages
# loads in flight) mostly filling and draining; more splits would not add useful
# parallelism, only partial-sum traffic.
MIN_TILES_PER_SPLIT = 4


def _skinny_kernel(
    x_ref,
    w_ref,
    *refs,
    rows,
    block_n,
    block_k,
    split_len,
    tiles_per_split,
    ragged_n,
    ragged_k,
    compute_dtype,
    scale_block_rows,
):
    # scale_block_rows: K rows per scale row of block-scaled FP8 weights (the scale ref comes
    # before the output then); None when there is no in-kernel scale.
    scale_ref, out_ref = refs if scale_block_rows else (None, refs[0])
    strip, split = pl.program_id(0), pl.program_id(1)
    num_k, num_n = w_ref.shape
    cols = strip * block_n + lax.iota(jnp.int32, block_n)
    row_ids = lax.iota(jnp.int32, DOT_ROWS)
    real_row = row_ids < rows
    k_lo = split * split_len
    col_ok = (cols < num_n)[None, :] if ragged_n else None

    def tile(i, acc):
        ks = k_lo + i * block_k + lax.iota(jnp.int32, block_k)
        # Every dimension is indexed by an int array (no slices): interpret mode
        # cannot mix slices with array indices in one masked load.
        x_mask = real_row[:, None]
        w_mask = col_ok
        if ragged_k:
            k_ok = ks < num_k
            x_mask = x_mask & k_ok[None, :]
            w_mask = k_ok[:, None] if w_mask is None else k_ok[:, None] & w_mask
        x = pltriton.load(x_ref.at[row_ids[:, None], ks[None, :]], mask=x_mask, other=0).astype(compute_dtype)
        if w_mask is None:
            w = w_ref[ks[:, None], cols[None, :]]  # the common case: an unmasked, fully coalesced tile
        else:
            w = pltriton.load(
                w_ref.at[ks[:, None], cols[None, :]], mask=w_mask, other=0.0
            )  # a float fill: FP8 takes no int
        # pl.dot is gone in this jax; dot_general with an f32 result lowers to tl.dot the same way.
        prod = lax.dot_general(x, w.astype(compute_dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        if scale_block_rows:
            # A K tile lies inside one scale block (block_k divides scale_block_rows).
            block = lax.div(k_lo + i * block_k, scale_block_rows)
            s_cols = cols if col_ok is None else jnp.minimum(cols, num_n - 1)
            prod = prod * scale_ref[block, s_cols][None, :]
        return acc + prod

    if isinstance(tiles_per_split, int):
        num_tiles = tiles_per_split  # every split has the same static trip count
    else:
        # The last split may be shorter: (total tiles, tiles per split).
        total, per = tiles_per_split
        num_tiles = jnp.minimum(per, total - split * per)
    acc = lax.fori_loop(0, num_tiles, tile, jnp.zeros((DOT_ROWS, block_n), jnp.float32))

    store_mask = real_row[:, None] if col_ok is None else real_row[:, None] & col_ok
    pltriton.store(out_ref.at[split, row_ids[:, None], cols[None, :]], acc, mask=store_mask)


class SkinnyPlan(NamedTuple):
    """Static launch settings, resolved from the shape and the tuning arguments."""

    block_n: int  # weight columns per program
    block_k: int  # K rows per weight tile (one loop iteration)
    num_splits: int  # K partitions; the grid is (ceil(N / block_n), num_splits)
    split_len: int  # K rows per split, a multiple of block_k
    num_warps: int
    num_stages: int


def skinny_matmul_plan(
    M: int, K: int, N: int, *, block_n=None, block_k=None, num_splits=None, num_warps=4, num_stages=3
) -> SkinnyPlan:
    """Default tiles and split-K for x[M, K] @ W[K, N].

    - block_n = block_k = 128 (fewer for a smaller N or K): a 32 KiB bf16 tile,
      so num_stages=3 buffers take 96 KiB of shared memory and two programs fit
      on an SM (228 KiB), i.e. up to ~192 KiB of weight loads in flight per SM,
      several times what Little's law asks for at HBM bandwidth. A row
      of 128 bf16 is 256 contiguous bytes: whole cache lines.
    - num_splits: enough K partitions that the grid reaches TARGET_PROGRAMS
      (4 per SM) when the column strips alone do not, but no split shorter than
      MIN_TILES_PER_SPLIT tiles. For Llama-3.1-8B with the defaults: qkv 48
      strips x 8 splits, o 32 x 8, gate_up 224 x 4, down 32 x 28,
      lm_head 1002 x 1 (532 to 1002 programs).

    M does not change the plan: the tile is 16 rows whatever M <= 16 is.
    """
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1..{MAX_ROWS} rows, got {M}")
    block_n = block_n or min(128, max(DOT_ROWS, next_pow2(N)))
    block_k = block_k or min(128, max(DOT_ROWS, next_pow2(K)))
    check_pow2("block_n", block_n)
    check_pow2("block_k", block_k)
    if block_n < DOT_ROWS or block_k < DOT_ROWS:
        raise ValueError(f"tl.dot needs block_n and block_k >= {DOT_ROWS}, got {block_n}, {block_k}")
    strips = -(-N // block_n)
    k_tiles = -(-K // block_k)
    if num_splits is None:
        # A power of two, as in choose_splits: it divides the power-of-two tile counts of most K.
        wanted = 1 if strips >= TARGET_PROGRAMS else next_pow2(-(-TARGET_PROGRAMS // strips))
        num_splits = max(1, min(wanted, k_tiles // MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(num_splits, k_tiles))
    per_split = -(-k_tiles // num_splits)
    # Rounding per_split up can leave trailing splits empty: drop them.
    num_splits = -(-k_tiles // per_split)
    return SkinnyPlan(block_n, block_k, num_splits, per_split * block_k, num_warps, num_stages)


@functools.partial(
    jax.jit,
    static_argnames=("block_n", "block_k", "num_splits", "num_warps", "num_stages", "interpret"),
)
def skinny_matmul(
    x, w, scale=None, *, block_n=None, block_k=None, num_splits=None, num_warps=4, num_stages=3, interpret=None
):
    """x [M, K] (M <= 16, any float dtype) @ w [K, N] -> f32 [M, N].

    x is cast to w's dtype for the products; accumulation is f32. Any K and N
    (a ragged last tile is masked). Tuning (see skinny_matmul_plan): block_n
    and block_k powers of two >= 16; num_splits K partitions (None: from the
    shape); num_warps and num_stages go to Triton.

    FP8 w comes with scale [in_blocks, N] f32 (kernels/ref.py: dequantize_fp8): its tiles
    are upcast to x's dtype in registers; one scale row multiplies the f32 sum after the
    kernel, several (block scales, K / in_blocks a power of two) each K tile's product.
    """
    (M, K), (K_w, N) = x.shape, w.shape
    if K != K_w:
        raise ValueError(f"x {x.shape} does not fit w {w.shape}")
    fp8 = jnp.dtype(w.dtype).itemsize == 1
    if fp8 != (scale is not None):
        raise ValueError("an FP8 weight needs its scale, and only an FP8 weight takes one")
    scale_block_rows = None
    if scale is not None and scale.shape[0] > 1:
        scale_block_rows = K // scale.shape[0]
        check_pow2("K rows per scale block", scale_block_rows)
        block_k = min(block_k or 128, scale_block_rows)
    plan = skinny_matmul_plan(
        M, K, N, block_n=block_n, block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages
    )
    k_tiles = -(-K // plan.block_k)
    per_split = plan.split_len // plan.block_k
    even = k_tiles % per_split == 0
    kernel = functools.partial(
        _skinny_kernel,
        rows=M,
        block_n=plan.block_n,
        block_k=plan.block_k,
        split_len=plan.split_len,
        tiles_per_split=per_split if even else (k_tiles, per_split),
        ragged_n=N % plan.block_n != 0,
        ragged_k=K % plan.block_k != 0,
        compute_dtype=x.dtype if fp8 else w.dtype,
        scale_block_rows=scale_block_rows,
    )
    inputs = (x, w) if scale_block_rows is None else (x, w, scale.astype(jnp.float32))
    partials = pl.pallas_call(
        kernel,
        grid=(-(-N // plan.block_n), plan.num_splits),
        out_shape=jax.ShapeDtypeStruct((plan.num_splits, M, N), jnp.float32),
        interpret=resolve_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        name=f"skinny_matmul{'_fp8' if fp8 else ''}_n{plan.block_n}_k{plan.block_k}_s{plan.num_splits}",
    )(*inputs)
    out = partials[0] if plan.num_splits == 1 else jnp.sum(partials, axis=0)
    return out * scale[0].astype(jnp.float32) if scale is not None and scale_block_rows is None else out

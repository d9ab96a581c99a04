"""RMSNorm with the residual add before it, in one kernel: Pallas over Triton.

A decoder layer adds each sublayer's output to the residual stream and normalises the sum
for the next sublayer. XLA emits that as three kernels on the GPU (the add, the sum of
squares, the scaling), each a launch and a round trip through HBM for a few kilobytes at
decode batch sizes; here one program per row reads x and y once and writes the sum and its
norm. The sum is rounded to the residual's dtype before it is normalised, as the add-then-norm
of the reference does, so the two differ only in the order of the squares' f32 summation.
y may be wider than x (a projection's float32 output): its rounding to x's dtype happens here
too, where XLA would spend one more kernel on it.

The row is padded to a power of two (Triton's arrays) and masked; one program holds a whole
row in registers, which suits model widths up to a few thousand (eight warps past 4096).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.kernels.backend import resolve_interpret
from jspec.kernels.paged_tiles import next_pow2


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis, computed in f32 and rounded to
    x's dtype before the weight multiplies it (HF's order)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def add_rms_norm_ref(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(x + y, rms_norm(x + y)): the new residual and the next sublayer's input, in x's dtype
    (y, a projection's float32 output for instance, rounded to it first)."""
    s = x + y.astype(x.dtype)
    return s, rms_norm(s, weight, eps)


def _add_rms_norm_kernel(x_ref, y_ref, w_ref, sum_ref, normed_ref, *, width, padded, eps):
    row = pl.program_id(0)
    cols = lax.iota(jnp.int32, padded)
    real = cols < width
    x = pltriton.load(x_ref.at[row, cols], mask=real, other=0)
    y = pltriton.load(y_ref.at[row, cols], mask=real, other=0)
    s = (x.astype(jnp.float32) + y.astype(sum_ref.dtype).astype(jnp.float32)).astype(sum_ref.dtype)
    s32 = s.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(s32 * s32) / width + eps)
    w = pltriton.load(w_ref.at[cols], mask=real, other=0)
    normed = w.astype(jnp.float32) * (s32 * inv).astype(sum_ref.dtype).astype(jnp.float32)
    pltriton.store(sum_ref.at[row, cols], s, mask=real)
    pltriton.store(normed_ref.at[row, cols], normed.astype(normed_ref.dtype), mask=real)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x, y, weight, *, eps: float, interpret=None):
    """x, y [T, H], weight [H] -> (x + y, rms_norm(x + y, weight)) as add_rms_norm_ref computes
    them: y rounded to x's dtype first, the norm in the dtype weight * x promotes to."""
    if x.ndim != 2 or x.shape != y.shape or weight.shape != x.shape[1:]:
        raise ValueError(f"add_rms_norm takes x, y [T, H] and weight [H], got {x.shape}, {y.shape}, {weight.shape}")
    T, H = x.shape
    padded = next_pow2(H)
    kernel = functools.partial(_add_rms_norm_kernel, width=H, padded=padded, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(T,),
        out_shape=(
            jax.ShapeDtypeStruct((T, H), x.dtype),
            jax.ShapeDtypeStruct((T, H), jnp.result_type(weight.dtype, x.dtype)),
        ),
        interpret=resolve_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=4 if padded <= 4096 else 8, num_stages=1),
        name=f"add_rms_norm_{padded}",
    )(x, y, weight)

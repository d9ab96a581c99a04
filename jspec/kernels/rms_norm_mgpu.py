"""RMSNorm with the residual add before it, in one kernel: Pallas over Mosaic GPU (Hopper).

The same contract as rms_norm.add_rms_norm (the Triton-backend kernel beside it): x + y rounded
to x's dtype, then its norm, from one read of x and y. One warpgroup per row. A TMA copy moves at
most 256 elements along each dimension, so each row travels as [H / 64, 64] (H a multiple of 64,
at most 16,384); the warpgroup holds it in registers in Mosaic GPU's strided layout, whose
full-array sum is the one reduction it needs, and that layout wants whole 1,024-element blocks:
a row that is not one (SmolLM2's 576) sits in a shared-memory buffer padded with zeros, which
add nothing to the sum of squares, and only its real part travels back.

What the kernel lacks raises MosaicUnsupported (mosaic_add_rms_norm_unsupported() asks first),
so that a caller can run the Triton-backend kernel instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.kernels.mgpu_tiles import MosaicUnsupported, interpret_params

# Elements of a row per shared-memory line: a row of a TMA box (<= 256), 128 bytes of bf16.
LINE = 64
MAX_LINES = 256  # a TMA box's other dimension
# The strided layout splits a buffer over 128 threads in vectors: whole blocks of this many lines.
LINES_PER_BLOCK = 16
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def mosaic_add_rms_norm_unsupported(width: int, x_dtype, y_dtype, w_dtype) -> str | None:
    """The first feature of this call that the Mosaic kernel lacks, or None if it runs it."""
    if width % LINE or width // LINE > MAX_LINES:
        return f"width {width} (a multiple of {LINE}, at most {LINE * MAX_LINES})"
    for name, dtype in (("x", x_dtype), ("y", y_dtype), ("weight", w_dtype)):
        if jnp.dtype(dtype) not in map(jnp.dtype, DTYPES):
            return f"{name} in {jnp.dtype(dtype).name} (16-bit or float32 only)"
    return None


def _add_rms_norm_kernel(x_ref, y_ref, w_ref, sum_ref, normed_ref, *, width, eps):
    row = lax.axis_index("row")
    lines = width // LINE
    buffer_lines = -(-lines // LINES_PER_BLOCK) * LINES_PER_BLOCK
    real = pl.ds(0, lines)

    def body(x_smem, y_smem, w_smem, sum_smem, normed_smem, copied):
        if buffer_lines > lines:
            for buf in (x_smem, y_smem, w_smem):
                buf[...] = jnp.zeros(buf.shape, buf.dtype)
            plgpu.commit_smem()  # the zeros land before the copies write over the real lines
        plgpu.copy_gmem_to_smem(x_ref.at[row], x_smem.at[real], copied.at[0])
        plgpu.copy_gmem_to_smem(y_ref.at[row], y_smem.at[real], copied.at[0])
        plgpu.copy_gmem_to_smem(w_ref, w_smem.at[real], copied.at[0])
        plgpu.barrier_wait(copied.at[0])
        x = x_smem[...].astype(jnp.float32)
        y = y_smem[...].astype(sum_smem.dtype).astype(jnp.float32)
        s = (x + y).astype(sum_smem.dtype)
        s32 = s.astype(jnp.float32)
        inv = lax.rsqrt(jnp.sum(s32 * s32) / width + eps)
        normed = w_smem[...].astype(jnp.float32) * (s32 * inv).astype(sum_smem.dtype).astype(jnp.float32)
        sum_smem[...] = s
        normed_smem[...] = normed.astype(normed_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(sum_smem.at[real], sum_ref.at[row])
        plgpu.copy_smem_to_gmem(normed_smem.at[real], normed_ref.at[row])
        plgpu.wait_smem_to_gmem(0)

    shape = (buffer_lines, LINE)
    pl.run_scoped(
        body,
        *(plgpu.SMEM(shape, ref.dtype) for ref in (x_ref, y_ref, w_ref, sum_ref, normed_ref)),
        plgpu.Barrier(num_arrivals=3, num_barriers=1),
    )


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm_mgpu(x, y, weight, *, eps: float, interpret=None):
    """rms_norm.add_rms_norm on Mosaic GPU: x, y [T, H], weight [H] -> (x + y, its RMSNorm),
    y rounded to x's dtype first. Raises MosaicUnsupported for what
    mosaic_add_rms_norm_unsupported() names. interpret: as the other Mosaic kernels'."""
    if x.ndim != 2 or x.shape != y.shape or weight.shape != x.shape[1:]:
        raise ValueError(f"add_rms_norm takes x, y [T, H] and weight [H], got {x.shape}, {y.shape}, {weight.shape}")
    T, H = x.shape
    feature = mosaic_add_rms_norm_unsupported(H, x.dtype, y.dtype, weight.dtype)
    if feature is not None:
        raise MosaicUnsupported(feature, kernel="add-and-norm")
    lines = H // LINE
    kernel = plgpu.kernel(
        functools.partial(_add_rms_norm_kernel, width=H, eps=eps),
        out_type=(
            jax.ShapeDtypeStruct((T, lines, LINE), x.dtype),
            jax.ShapeDtypeStruct((T, lines, LINE), jnp.result_type(weight.dtype, x.dtype)),
        ),
        grid=(T,),
        grid_names=("row",),
        interpret=interpret_params(interpret),
        kernel_name=f"add_rms_norm_mgpu_{H}",
    )
    total, normed = kernel(x.reshape(T, lines, LINE), y.reshape(T, lines, LINE), weight.reshape(lines, LINE))
    return total.reshape(T, H), normed.reshape(T, H)

"""The dense projections' matmul: XLA's dot, or a Pallas skinny matmul for decode rows.

A batch-1 decode step is bound by reading the weights, and XLA's skinny matmuls read them
below the HBM bandwidth. `JSPEC_SKINNY_MATMUL=pallas` sends every projection of at most 16
rows through kernels/skinny_matmul.py (Pallas' Triton backend) instead, `mosaic` every one of
at most 64 rows whose shape kernels/skinny_matmul_mgpu.py covers (Mosaic GPU; other shapes keep
XLA's dot), `xla_padded` pads a one-row product to two rows: XLA rewrites a one-row dot of a
small weight into a multiply and a reduction, and for some shapes writes the float32 product to
memory between the two, where two rows take its GEMM path. Read when a step is traced, so set
per process. bf16 weights on one GPU only: under
a mesh XLA's dot partitions the sharded weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kernels.backend import env_choice, one_gpu
from jspec.kernels.skinny_matmul import MAX_ROWS, skinny_matmul
from jspec.kernels.skinny_matmul_mgpu import mosaic_skinny_unsupported, skinny_matmul_mgpu
from jspec.layers.quant import fp8_dense_f32, is_fp8

SKINNY_MATMUL_ENV = "JSPEC_SKINNY_MATMUL"


def skinny_backend() -> str:
    return env_choice(SKINNY_MATMUL_ENV, "xla", ("xla", "pallas", "mosaic", "xla_padded"))


def dense_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, in] @ w [in, n] -> f32 [T, n]; w may be an Fp8Weight (layers/quant.py picks its path)."""
    if is_fp8(w):
        return fp8_dense_f32(x, w)
    backend = skinny_backend()
    if w.ndim == 2 and w.dtype == jnp.bfloat16 and one_gpu():
        if backend == "pallas" and x.shape[0] <= MAX_ROWS:
            return skinny_matmul(x, w)
        if backend == "mosaic" and mosaic_skinny_unsupported(x.shape[0], *w.shape, w.dtype) is None:
            return skinny_matmul_mgpu(x, w)
        if backend == "xla_padded" and x.shape[0] == 1:
            return two_row_dot(x, w)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def two_row_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [1, in] @ w [in, n] -> f32 [1, n], computed as a product of two rows (the second zero)."""
    return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w, preferred_element_type=jnp.float32)[:1]

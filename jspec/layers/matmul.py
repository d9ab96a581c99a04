"""The dense projections' matmul: XLA's dot, or the Pallas skinny matmul for decode rows.

A batch-1 decode step is bound by reading the weights, and XLA's skinny matmuls read them
below the HBM bandwidth. `JSPEC_SKINNY_MATMUL=pallas` sends every projection of at most 16
rows through kernels/skinny_matmul.py instead; read when a step is traced, so set per
process. bf16 weights on one GPU only: under a mesh XLA's dot partitions the sharded weights.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jspec.kernels.skinny_matmul import MAX_ROWS, skinny_matmul
from jspec.layers.quant import fp8_dense_f32, is_fp8

SKINNY_MATMUL_ENV = "JSPEC_SKINNY_MATMUL"


def skinny_backend() -> str:
    value = os.environ.get(SKINNY_MATMUL_ENV, "xla")
    if value not in ("xla", "pallas"):
        raise ValueError(f"{SKINNY_MATMUL_ENV}={value!r}: expected 'xla' or 'pallas'")
    return value


def dense_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, in] @ w [in, n] -> f32 [T, n]; w may be an Fp8Weight (layers/quant.py picks its path)."""
    if is_fp8(w):
        return fp8_dense_f32(x, w)
    if (
        x.shape[0] <= MAX_ROWS
        and w.ndim == 2
        and w.dtype == jnp.bfloat16
        and skinny_backend() == "pallas"
        and jax.default_backend() == "gpu"
        and jax.device_count() == 1
    ):
        return skinny_matmul(x, w)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)

"""The dense projections' matmul: XLA's dot, or a Pallas skinny matmul for decode rows.

A batch-1 decode step is bound by reading the weights, and at one row XLA's dot is not its
best: it rewrites a small weight's one-row dot into a multiply and a reduction (for some
shapes two kernels with the float32 product written to memory between them), and a large
weight's one-row dot runs slower than the same dot over two rows. `JSPEC_SKINNY_MATMUL` picks,
read when a step is traced (so set per process), for bf16 weights on one GPU (under a mesh
XLA's dot partitions the sharded weights):
- auto (the default): a one-row product of a weight of at least PADDED_MIN_WEIGHT_ELEMENTS
  runs as a two-row one (two_row_dot), where the dot's gain outweighs the pad and the slice
  around it; everything else is XLA's dot;
- xla: XLA's dot always; xla_padded: every one-row product padded to two rows;
- pallas: every projection of at most 16 rows through kernels/skinny_matmul.py (Pallas'
  Triton backend); mosaic: every one of at most 64 rows whose shape
  kernels/skinny_matmul_mgpu.py covers (Mosaic GPU; other shapes keep XLA's dot).
benchmarks/NOTES.md ("One-row projections") has the measurements behind the default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.kernels.backend import env_choice, one_gpu
from jspec.kernels.skinny_matmul import MAX_ROWS, skinny_matmul
from jspec.kernels.skinny_matmul_mgpu import mosaic_skinny_unsupported, skinny_matmul_mgpu
from jspec.layers.quant import fp8_dense_f32, is_fp8

SKINNY_MATMUL_ENV = "JSPEC_SKINNY_MATMUL"
# Between a small model's projections (where the pad and slice kernels cost more than the
# two-row dot saves) and a large one's (where the two-row dot wins).
PADDED_MIN_WEIGHT_ELEMENTS = 1 << 23


def skinny_backend() -> str:
    return env_choice(SKINNY_MATMUL_ENV, "auto", ("auto", "xla", "xla_padded", "pallas", "mosaic"))


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
        if x.shape[0] == 1 and (
            backend == "xla_padded" or (backend == "auto" and w.size >= PADDED_MIN_WEIGHT_ELEMENTS)
        ):
            return two_row_dot(x, w)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def two_row_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [1, in] @ w [in, n] -> f32 [1, n], computed as a product of two rows (the second zero)."""
    return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w, preferred_element_type=jnp.float32)[:1]

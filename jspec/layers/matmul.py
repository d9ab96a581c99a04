"""The dense projections' matmul: XLA's dot, or a Pallas skinny matmul for decode rows.

A batch-1 decode step is bound by reading the weights, and at one row XLA's dot is not its
best: it rewrites a small weight's one-row dot into a multiply and a reduction (for some
shapes two kernels with the float32 product written to memory between them), and a large
weight's one-row dot runs slower than the same dot over two rows. `JSPEC_SKINNY_MATMUL` picks,
read when a step is traced (so set per process), for bf16 weights on one GPU (under a mesh
XLA's dot partitions the sharded weights):
- auto (the default): a one-row product of a weight of at least PADDED_MIN_WEIGHT_ELEMENTS
  runs as a two-row one (two_row_dot), where the dot's gain outweighs the pad and the slice
  around it; everything else is XLA's dot; on one GPU, the smaller weights laid out as xla_nk
  lays them out wherever that layout applies (engine/build.out_in_refusal says where it does not);
- xla: XLA's dot always; xla_padded: every one-row product padded to two rows;
- pallas: every projection of at most 16 rows through kernels/skinny_matmul.py (Pallas'
  Triton backend); mosaic: every one of at most 64 rows whose shape
  kernels/skinny_matmul_mgpu.py covers (Mosaic GPU; other shapes keep XLA's dot);
- xla_nk: as auto, with the decoder layers' projection weights below
  PADDED_MIN_WEIGHT_ELEMENTS stored [out, in] (OutInWeight, laid out when the engine is
  built) on any one device, and a configuration it does not apply to refused by name: a
  one-row product is then one reduction along memory, where the [in, out] weight gives a
  multiply and a reduction with a float32 product between them.
benchmarks/NOTES.md ("One-row projections") has the measurements behind the default.
"""

from __future__ import annotations

import dataclasses

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
# The decoder layers' dense projections (models/llama.py), the weights xla_nk may lay out [out, in].
LAYER_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


def skinny_backend() -> str:
    return env_choice(SKINNY_MATMUL_ENV, "auto", ("auto", "xla", "xla_padded", "pallas", "mosaic", "xla_nk"))


def lays_out_projections_out_in() -> bool:
    """Whether the engine's build lays the small projection weights out [out, in]: asked for
    (xla_nk), or the default on one GPU, where one reduction per one-row product saves a
    kernel a projection (on the CPU XLA's dot is one kernel either way)."""
    backend = skinny_backend()
    return backend == "xla_nk" or (backend == "auto" and one_gpu())


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutInWeight:
    """A projection weight stored [..., out, in] (the checkpoint's own nn.Linear layout) that
    the layers use as [..., in, out]: shape and ndim are the latter's. A stacked one's layer
    slice (a scan's) is one too."""

    t: jax.Array

    @property
    def shape(self):
        return (*self.t.shape[:-2], self.t.shape[-1], self.t.shape[-2])

    @property
    def ndim(self) -> int:
        return self.t.ndim

    @property
    def dtype(self):
        return self.t.dtype

    @property
    def size(self) -> int:
        return self.t.size


def with_out_in_projections(params, per_layer_ndim: int):
    """params with each decoder layer's float projection weights below PADDED_MIN_WEIGHT_ELEMENTS
    elements a layer as OutInWeight; per_layer_ndim is 2 for per-layer arrays, 3 for stacked
    ones. Others (FP8, sharded, large) stay as they are."""

    def lay_out(w):
        if (
            isinstance(w, jax.Array)
            and w.ndim == per_layer_ndim
            and jnp.issubdtype(w.dtype, jnp.floating)
            and w.shape[-1] * w.shape[-2] < PADDED_MIN_WEIGHT_ELEMENTS
        ):
            return OutInWeight(jnp.swapaxes(w, -1, -2))
        return w

    def layer(lp):
        return {k: lay_out(v) if k in LAYER_PROJECTIONS else v for k, v in lp.items()}

    layers = params["layers"]
    return {**params, "layers": [layer(lp) for lp in layers] if isinstance(layers, list) else layer(layers)}


def dense_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, in] @ w [in, n] -> f32 [T, n]; w may be an Fp8Weight (layers/quant.py picks its path)
    or an OutInWeight (contracted on its minor dimension)."""
    if isinstance(w, OutInWeight):
        return jax.lax.dot_general(x, w.t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if is_fp8(w):
        return fp8_dense_f32(x, w)
    backend = skinny_backend()
    if w.ndim == 2 and w.dtype == jnp.bfloat16 and one_gpu():
        if backend == "pallas" and x.shape[0] <= MAX_ROWS:
            return skinny_matmul(x, w)
        if backend == "mosaic" and mosaic_skinny_unsupported(x.shape[0], *w.shape, w.dtype) is None:
            return skinny_matmul_mgpu(x, w)
        if x.shape[0] == 1 and (
            backend == "xla_padded" or (backend in ("auto", "xla_nk") and w.size >= PADDED_MIN_WEIGHT_ELEMENTS)
        ):
            return two_row_dot(x, w)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def two_row_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [1, in] @ w [in, n] -> f32 [1, n], computed as a product of two rows (the second zero)."""
    return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w, preferred_element_type=jnp.float32)[:1]

"""FP8 (e4m3) projection weights: the quantized weight, its matmul paths and per-channel quantizing.

A quantized projection keeps its weight in HBM as float8_e4m3fn and multiplies by f32 scales
after (or, for block scales, inside) the product, so a decode step reads one byte per weight.
Activations stay in the model's dtype (weight-only FP8: decode is bound by the weight reads,
not by the math) unless the w8a8 path quantizes them too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config.engine import FP8_GEMM_BACKENDS
from jspec.kernels.backend import one_gpu
from jspec.kernels.ref import dequantize_fp8
from jspec.kernels.skinny_matmul import MAX_ROWS, skinny_matmul
from jspec.kernels.skinny_matmul_mgpu import mosaic_skinny_unsupported, skinny_matmul_mgpu

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
# The projections a decoder layer holds as [in, out] weights (an MoE layer's experts are not
# among them).
QUANTIZED_LEAVES = ("wqkv", "wo", "w_gate_up", "w_down")
# Where auto sends a one-row product to the GEMV: an 8B-class projection, where the GEMV beats
# XLA's dot at one row; a small model's projections run faster through XLA's dot at any row
# count.
FP8_GEMV_MIN_WEIGHT_ELEMENTS = 1 << 23


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """w [..., in, out] float8_e4m3fn and scale [..., in_blocks, out] f32: the weight is
    w * scale, each scale row covering in / in_blocks consecutive input rows (one row: per
    tensor or per output channel; several: block scales). Both arrays keep the output axis
    last, so column operations (fusing, TP blocking, repeating KV heads) map over both alike.

    gemm (static) picks the matmul: "xla" (the upcast inside XLA's dot), "pallas" (the
    skinny GEMV that upcasts in registers, for decode rows on one GPU), "mosaic" (the Mosaic
    GPU GEMV), "w8a8" (XLA's FP8 x FP8 GEMM over activations quantized per token) or "auto"
    (the GEMV for one row of a large weight, XLA's dot for the rest)."""

    w: jax.Array
    scale: jax.Array
    gemm: str = dataclasses.field(default="xla", metadata=dict(static=True))

    @property
    def shape(self):
        return self.w.shape

    @property
    def ndim(self) -> int:
        return self.w.ndim

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def in_blocks(self) -> int:
        return self.scale.shape[-2]

    def __getitem__(self, index):
        """Indexes the leading (layer) axes or the output axis of both arrays; never the input axis."""
        return Fp8Weight(self.w[index], self.scale[index], self.gemm)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_fp8(self.w, self.scale).astype(dtype)


def is_fp8(w) -> bool:
    return isinstance(w, Fp8Weight)


def fp8_dense_f32(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x [T, in] @ w ([in, out], or the TP layout [in, tp, n]) -> f32 [T, out...]."""
    if w.gemm == "auto":
        large = x.shape[0] == 1 and w.w.size >= FP8_GEMV_MIN_WEIGHT_ELEMENTS
        w = dataclasses.replace(w, gemm="pallas" if large else "xla")
    if w.gemm == "pallas" and x.shape[0] <= MAX_ROWS and w.ndim == 2 and one_gpu() and gemv_takes(w):
        return skinny_matmul(x, w.w, scale=w.scale)
    if w.gemm == "mosaic" and w.ndim == 2 and one_gpu() and mosaic_gemv_takes(x, w):
        return skinny_matmul_mgpu(x, w.w, w.scale)
    if w.gemm == "w8a8":
        return fp8_dot_w8a8(x, w.w, w.scale)
    return fp8_dot_xla(x, w.w, w.scale)


def gemv_takes(w: Fp8Weight) -> bool:
    """The GEMV's tiles hold whole scale blocks: block scales need a power-of-two block height
    (XLA's dot takes any other)."""
    rows = w.shape[0] // w.in_blocks
    return w.in_blocks == 1 or rows & (rows - 1) == 0


def mosaic_gemv_takes(x, w: Fp8Weight) -> bool:
    """The Mosaic GPU GEMV's cover: decode rows, whole tiles, one scale row or blocks of whole tiles."""
    return mosaic_skinny_unsupported(x.shape[0], *w.shape, w.w.dtype, scale_rows=w.in_blocks) is None


def fp8_dot_xla(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """XLA's path: the weight is converted inside the jitted dot (XLA fuses the convert into the
    GEMM's operand read), per-channel scales multiply the f32 result, block scales each block's
    partial product."""
    compute = x.dtype  # bf16 on the GPU: the weight's upcast is exact
    nb = scale.shape[0]
    if nb == 1:
        y = jnp.tensordot(x, w.astype(compute), axes=1, preferred_element_type=jnp.float32)
        return y * scale[0]
    K = w.shape[0]
    xb = x.reshape(x.shape[0], nb, K // nb)
    wb = w.reshape(nb, K // nb, *w.shape[1:]).astype(compute)
    partial = jnp.einsum("tbk,bk...->tb...", xb, wb, preferred_element_type=jnp.float32)
    return jnp.sum(partial * scale[None], axis=1)


def fp8_dot_w8a8(x: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """W8A8: each row of x quantized to e4m3 by its own absolute maximum, an FP8 x FP8 dot with
    an f32 result (on Hopper XLA's GEMM rewriter makes it a cuBLASLt FP8 GEMM), then both
    scales on the f32 product. One scale row only: block scales would need per-block
    activation scales inside the GEMM."""
    if scale.shape[0] != 1:
        raise NotImplementedError("the w8a8 FP8 GEMM takes per-tensor or per-channel weight scales, not block scales")
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    x8 = jnp.clip(x32 / x_scale, -FP8_MAX, FP8_MAX).astype(FP8)
    y = jax.lax.dot_general(x8, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return y * x_scale.reshape(x_scale.shape[0], *(1,) * (y.ndim - 1)) * scale[0]


@jax.jit
def quantize_per_channel(w: jax.Array) -> Fp8Weight:
    """w [..., in, out] -> Fp8Weight with one scale per output column (SGLang's --quantization fp8)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = jnp.clip(w32 / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return Fp8Weight(q, scale)


def _layer_dicts(layers):
    return list(layers) if isinstance(layers, (list, tuple)) else [layers]


def has_fp8_weights(params) -> bool:
    return any(is_fp8(lp.get(n)) for lp in _layer_dicts(params["layers"]) for n in QUANTIZED_LEAVES)


def quantize_params(params, method: str | None):
    """params with every decoder projection in FP8 per output channel (method "fp8"); weights
    already FP8 (an FP8 checkpoint) stay as they are. None: params unchanged."""
    if method is None:
        return params
    if method != "fp8":
        raise ValueError(f"unknown quantization {method!r}; jspec implements 'fp8'")

    def layer(lp):
        if "router" in lp:
            raise NotImplementedError("--quantization fp8 of MoE experts is not implemented (dense models only)")
        return {n: quantize_per_channel(a) if n in QUANTIZED_LEAVES and not is_fp8(a) else a for n, a in lp.items()}

    layers = params["layers"]
    layers = [layer(lp) for lp in layers] if isinstance(layers, (list, tuple)) else layer(layers)
    return {**params, "layers": layers}


def with_fp8_gemm(params, backend: str):
    """params with every FP8 weight's matmul path set: "xla", "pallas" (the Pallas GEMV, which
    upcasts in registers and reads each byte once, for decode rows on one GPU), "mosaic" (the
    Mosaic GPU GEMV, upcasting in shared memory; one scale row), "w8a8", or
    "auto": the Pallas GEMV for a one-row product of a weight of at least
    FP8_GEMV_MIN_WEIGHT_ELEMENTS (a few percent faster there), XLA's dot for every other
    (the fastest at 16 rows and on small projections; benchmarks/NOTES.md, bench_fp8)."""
    if backend not in FP8_GEMM_BACKENDS:
        raise ValueError(f"unknown fp8_gemm_backend {backend!r}; choose one of {FP8_GEMM_BACKENDS}")
    if backend == "w8a8" and any(a.in_blocks > 1 for a in jax.tree.leaves(params, is_leaf=is_fp8) if is_fp8(a)):
        raise NotImplementedError("fp8_gemm_backend w8a8 takes per-tensor or per-channel FP8 weights, not block scales")
    return jax.tree.map(
        lambda a: dataclasses.replace(a, gemm=backend) if is_fp8(a) else a, params, is_leaf=lambda a: is_fp8(a)
    )

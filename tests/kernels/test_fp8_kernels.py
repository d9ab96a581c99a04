"""FP8 weights' matmuls: the Pallas skinny GEMV (interpreted) and XLA's path against the reference,
and both lowered for an abstract H200 with the weight kept FP8."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import lower_for_cuda

from jspec.kernels.ref import dequantize_fp8, skinny_matmul_ref
from jspec.kernels.skinny_matmul import skinny_matmul
from jspec.layers.quant import FP8, Fp8Weight, fp8_dot_xla, quantize_per_channel

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def fp8_weight(K, N, in_blocks, seed):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((K, N)) * 8, jnp.float32).astype(FP8)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (in_blocks, N)) / 64, jnp.float32)
    return w, scale


@pytest.mark.parametrize(
    "M,K,N,in_blocks,tuning",
    [
        (1, 256, 384, 1, {}),  # per channel: the scale multiplies the summed partials
        (5, 200, 96, 1, dict(block_n=32, block_k=64)),  # ragged K and N
        (3, 256, 160, 4, {}),  # block scales: 64 K rows per scale row, block_k lowered to 64
        (16, 512, 64, 4, dict(block_k=32, num_splits=2)),  # several tiles per scale row, split K
        (2, 384, 48, 3, dict(block_n=16)),  # 128-row blocks (DeepSeek's), ragged N
    ],
)
def test_skinny_matmul_fp8_matches_reference(M, K, N, in_blocks, tuning):
    w, scale = fp8_weight(K, N, in_blocks, seed=M + K + N)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.float32)
    out = skinny_matmul(x, w, scale, **tuning)
    ref = skinny_matmul_ref(x, w, scale)
    assert out.shape == (M, N) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5 * np.sqrt(K))


def test_skinny_matmul_fp8_refuses_a_missing_scale():
    w, scale = fp8_weight(64, 32, 1, 0)
    with pytest.raises(ValueError, match="FP8 weight needs its scale"):
        skinny_matmul(jnp.ones((1, 64)), w)
    with pytest.raises(ValueError, match="only an FP8 weight"):
        skinny_matmul(jnp.ones((1, 64)), w.astype(jnp.float32), scale)


@pytest.mark.parametrize("in_blocks", [1, 4])
@pytest.mark.parametrize("tp", [None, 2])
def test_fp8_dot_xla_matches_reference(in_blocks, tp):
    w, scale = fp8_weight(256, 96, in_blocks, seed=in_blocks)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((7, 256)), jnp.float32)
    ref = skinny_matmul_ref(x, w, scale)
    if tp:  # the tensor-parallel layout [in, tp, n / tp] of both arrays
        w, scale = w.reshape(256, tp, -1), scale.reshape(in_blocks, tp, -1)
    out = fp8_dot_xla(x, w, scale).reshape(7, 96)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_quantize_per_channel_error_bound():
    """e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself, relative (or of the
    column's smallest normal step); the column's largest magnitude maps to 448 exactly."""
    w = jax.random.normal(jax.random.key(0), (3, 64, 48)) * jnp.linspace(0.01, 3, 48)
    q = quantize_per_channel(w)
    assert q.w.dtype == FP8 and q.scale.shape == (3, 1, 48)
    deq = dequantize_fp8(q.w, q.scale)
    err = jnp.abs(deq - w)
    assert bool(jnp.all(err <= jnp.maximum(jnp.abs(w) * 2.0**-4, q.scale * 2.0**-9)))
    assert bool(jnp.all(jnp.max(jnp.abs(q.w.astype(jnp.float32)), axis=-2) == 448.0))
    # An Fp8Weight indexes its layers as its arrays do.
    assert q[1].w.shape == (64, 48) and q[1].scale.shape == (1, 48)


BF16 = jnp.bfloat16


@pytest.mark.parametrize(
    "K,N,in_blocks,tuning",
    [
        (4096, 6144, 1, {}),  # Llama-3.1-8B qkv, per channel
        (14336, 4096, 1, {}),  # down
        (4096, 6144, 32, {}),  # DeepSeek 128 x 128 blocks: a scale row per K tile
        (14336, 4096, 112, dict(block_k=64, num_splits=3)),  # two K tiles per scale row, uneven splits
    ],
)
def test_skinny_matmul_fp8_lowers_for_cuda(K, N, in_blocks, tuning):
    specs = (
        jax.ShapeDtypeStruct((1, K), BF16),
        jax.ShapeDtypeStruct((K, N), FP8),
        jax.ShapeDtypeStruct((in_blocks, N), jnp.float32),
    )
    text = lower_for_cuda(functools.partial(skinny_matmul, interpret=False, **tuning), *specs).as_text()
    assert "__gpu$xla.gpu.triton" in text
    # The weight reaches the kernel as FP8: one byte per weight read from HBM.
    assert f"tensor<{K}x{N}xf8E4M3FN>" in text and f"tensor<{K}x{N}xbf16>" not in text


@pytest.mark.parametrize("in_blocks", [1, 32])
def test_fp8_dot_xla_lowers_for_cuda_with_the_weight_fp8(in_blocks):
    """The weight enters the program FP8 and is converted only as the dot's operand (no bf16
    copy of it is an argument or a result). That XLA's GPU compiler fuses the convert into the
    GEMM is checked on the GPU (benchmarks/bench_fp8.py reads the optimized HLO)."""
    K, N = 4096, 6144
    fn = lambda x, w, s: fp8_dot_xla(x, w, s)  # noqa: E731
    specs = (
        jax.ShapeDtypeStruct((1, K), BF16),
        jax.ShapeDtypeStruct((K, N), FP8),
        jax.ShapeDtypeStruct((in_blocks, N), jnp.float32),
    )
    text = lower_for_cuda(fn, *specs).as_text()
    signature = re.search(r"func.func public @main\((.*?)\)\s*->", text).group(1)
    assert "f8E4M3FN" in signature and "bf16>" in signature and f"{K}x{N}xbf16" not in signature
    assert re.search(r"stablehlo.convert .*f8E4M3FN>\) -> tensor<[0-9x]*xbf16>", text)


def test_fp8_weight_dequantize():
    w, scale = fp8_weight(128, 32, 2, 3)
    q = Fp8Weight(w, scale)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(dequantize_fp8(w, scale)))

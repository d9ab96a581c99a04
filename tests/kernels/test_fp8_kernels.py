"""FP8 weights' matmuls: the Pallas skinny GEMV (interpreted) and XLA's path against the reference,
and both lowered for an abstract H200 with the weight kept FP8."""

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from support.lowering import lower_for_cuda
from support.precision import tolerance
from test_kernels import LAYER, SM_SCALE, paged_problem, ragged_queries, random_tree_mask, rel_err

from jspec.config.model import ModelConfig
from jspec.kernels.paged_decode import paged_decode
from jspec.kernels.paged_extend import paged_extend
from jspec.kernels.ref import dequantize_fp8, paged_decode_ref, paged_extend_ref, skinny_matmul_ref
from jspec.kernels.skinny_matmul import skinny_matmul
from jspec.kvcache.pool import create_kv_pool, kv_cache_dtype, write_kv
from jspec.layers.quant import FP8, Fp8Weight, fp8_dot_w8a8, fp8_dot_xla, gemv_takes, quantize_per_channel

TINY_CFG = ModelConfig("llama", 64, 32, 64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2)

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
    # x stays float32 here (a TF32 dot on the GPU rounds it; e4m3 weights are exact in TF32).
    tol = tolerance()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=tol.rtol, atol=tol.atol * np.sqrt(K))


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
    tol = tolerance()  # XLA's float32 dot: TF32 on the GPU, as the kernels' are
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=tol.rtol, atol=10 * tol.atol)


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
        (4000, 1000, 1, dict(block_n=64, block_k=256)),  # ragged K and N: masked FP8 loads
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


# --- FP8 KV cache: the paged kernels read e4m3 pages (stored as bytes) and upcast them in registers ---

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def fp8_paged_problem(seed, seq_lens, page_size, num_kv_heads=2, head_dim=64):
    """A poisoned (NaN) FP8 pool as the engine stores it (e4m3 bytes), and the same pool upcast
    to f32 (what the kernels must see)."""
    k, v, tables = paged_problem(
        np.random.default_rng(seed), seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    k8, v8 = (a.astype(E4M3) for a in (k, v))
    return k8.view(np.uint8), v8.view(np.uint8), k8.astype(np.float32), v8.astype(np.float32), tables


@pytest.mark.parametrize(
    "q_dtype,page_size,tuning",
    [
        (jnp.float32, 16, dict(block_n=32, num_splits=1)),
        (jnp.float32, 4, dict(block_n=16, num_splits=3)),  # tiles over pages, split K
        (jnp.bfloat16, 16, dict(block_n=32, num_splits=2)),  # bf16 q: the tiles upcast to bf16
    ],
)
def test_paged_decode_fp8_kv_matches_reference(q_dtype, page_size, tuning):
    seq_lens = np.array([0, 1, 2 * page_size + 3, 5 * page_size + 7], np.int32)
    k8, v8, k32, v32, tables = fp8_paged_problem(page_size, seq_lens, page_size)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((len(seq_lens), 8, 64)), q_dtype)
    layer = jnp.array([LAYER], jnp.int32)
    out = paged_decode(q, k8, v8, layer, seq_lens, tables, sm_scale=SM_SCALE, min_split_tokens=16, **tuning)
    ref = paged_decode_ref(q, k8, v8, layer, seq_lens, tables, sm_scale=SM_SCALE)
    # The reference over the FP8 pool is the reference over its exact f32 upcast.
    ref32 = paged_decode_ref(q, k32, v32, layer, seq_lens, tables, sm_scale=SM_SCALE)
    assert out.dtype == q_dtype and not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(ref32, np.float32))
    assert rel_err(out, ref) < tolerance(q_dtype).rel


@pytest.mark.parametrize("tree", [False, True])
def test_paged_extend_fp8_kv_matches_reference(tree):
    page_size, max_q_len = 8, 5
    seq_lens = np.array([7, 0, 19, 26], np.int32)
    q_lens = np.array([3, 0, 5, 1])
    k8, v8, _, _, tables = fp8_paged_problem(7, seq_lens, page_size)
    rng = np.random.default_rng(2)
    q, query_start = ragged_queries(rng, q_lens, 8, 64, pad_rows=3)
    mask = random_tree_mask(rng, len(seq_lens), max_q_len) if tree else None
    args = (q, k8, v8, jnp.array([LAYER], jnp.int32), seq_lens, tables, query_start)
    out = paged_extend(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, block_n=16)
    ref = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < tolerance().rel


def test_write_kv_saturates_into_fp8():
    cache = create_kv_pool(TINY_CFG, 2, 4, kv_cache_dtype("fp8_e4m3", jnp.bfloat16)).k
    assert cache.dtype == jnp.uint8
    new = jnp.array([[[1000.0, -1e6]], [[0.1, -3.0]]], jnp.bfloat16)
    cache = write_kv(cache, jnp.int32(1), jnp.array([1, 8]), new)  # slot 8 is past the pool: dropped
    values = np.asarray(cache).view(E4M3).astype(np.float32)
    np.testing.assert_array_equal(values[1, 0, 1, 0], [448.0, -448.0])
    assert np.count_nonzero(values) == 2


@pytest.mark.parametrize("tree", [False, True])
def test_paged_attention_fp8_kv_lowers_for_cuda(tree):
    """Decode and extend (causal or tree) over an FP8 pool with bf16 queries, for an H200."""
    L, P, S, Hkv, D, B = 4, 257, 16, 8, 128, 8
    cache = jax.ShapeDtypeStruct((L, P, S, Hkv, D), jnp.uint8)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    dec = functools.partial(paged_decode, sm_scale=0.1, interpret=False)
    text = lower_for_cuda(
        dec, jax.ShapeDtypeStruct((B, 32, D), BF16), cache, cache, i32(), i32(B), i32(B, 32)
    ).as_text()
    assert "__gpu$xla.gpu.triton" in text and f"tensor<{L}x{P}x{S}x{Hkv}x{D}xui8>" in text
    Q = 8
    mask = (jax.ShapeDtypeStruct((B, Q, Q), jnp.bool_),) if tree else ()
    ext = lambda *a: paged_extend(*a[:7], sm_scale=0.1, max_q_len=Q, mask=a[7] if tree else None, interpret=False)  # noqa: E731
    specs = (jax.ShapeDtypeStruct((B * Q, 32, D), BF16), cache, cache, i32(), i32(B), i32(B, 32), i32(B + 1), *mask)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(ext, *specs).as_text()


@pytest.mark.parametrize("tp", [None, 2])
def test_fp8_dot_w8a8_is_within_activation_rounding(tp):
    """W8A8 equals the weight-only product of x rounded to e4m3 by its row's scale (amax / 448),
    and stays within e4m3's rounding (3 mantissa bits) of the unrounded x's."""
    w, scale = fp8_weight(256, 96, 1, seed=5)
    xn = np.random.default_rng(2).standard_normal((7, 256)).astype(np.float32) * np.arange(1, 8)[:, None]
    sx = np.abs(xn).max(axis=1, keepdims=True) / 448
    x_rounded = (xn / sx).astype(E4M3).astype(np.float32) * sx
    want = np.asarray(skinny_matmul_ref(jnp.asarray(x_rounded), w, scale))
    exact = np.asarray(skinny_matmul_ref(jnp.asarray(xn), w, scale))
    if tp:
        w, scale = w.reshape(256, tp, -1), scale.reshape(1, tp, -1)
    out = np.asarray(fp8_dot_w8a8(jnp.asarray(xn), w, scale)).reshape(7, 96)
    # FP8 operands multiply exactly on every backend: this bound does not follow the backend.
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)
    assert np.all(np.linalg.norm(out - exact, axis=1) < 2**-4 * np.linalg.norm(exact, axis=1))
    with pytest.raises(NotImplementedError, match="not block scales"):
        fp8_dot_w8a8(jnp.asarray(xn), *fp8_weight(256, 96, 2, seed=5))


def test_fp8_dot_w8a8_lowers_for_cuda_as_an_fp8_dot():
    K, N = 4096, 6144
    specs = (
        jax.ShapeDtypeStruct((64, K), BF16),
        jax.ShapeDtypeStruct((K, N), FP8),
        jax.ShapeDtypeStruct((1, N), jnp.float32),
    )
    text = lower_for_cuda(fp8_dot_w8a8, *specs).as_text()
    # Both operands of the dot are FP8 (what XLA's GEMM rewriter turns into a cuBLASLt FP8 GEMM).
    assert re.search(r"stablehlo.dot_general .*\(tensor<64x4096xf8E4M3FN>, tensor<4096x6144xf8E4M3FN>\)", text)


def test_the_gemv_takes_power_of_two_scale_blocks_only():
    w, _ = fp8_weight(384, 32, 1, 0)
    assert gemv_takes(Fp8Weight(w, jnp.ones((1, 32))))
    assert gemv_takes(Fp8Weight(w, jnp.ones((3, 32))))  # 128-row blocks
    assert not gemv_takes(Fp8Weight(w, jnp.ones((4, 32))))  # 96-row blocks: XLA's dot


def test_auto_sends_one_row_of_a_large_weight_to_the_gemv_and_the_rest_to_xla(monkeypatch):
    """--fp8-gemm-backend auto (the default) on one GPU: the Pallas GEMV for a one-row product of
    a weight of at least FP8_GEMV_MIN_WEIGHT_ELEMENTS, XLA's dot for a smaller weight or more
    rows (read off the lowered programs: a Pallas call is there or not)."""
    from jspec.layers import quant

    monkeypatch.setattr(quant, "one_gpu", lambda: True)
    n = quant.FP8_GEMV_MIN_WEIGHT_ELEMENTS // 1024

    def gemv(rows, out, backend="auto"):
        x = jax.ShapeDtypeStruct((rows, 1024), BF16)
        w = Fp8Weight(jax.ShapeDtypeStruct((1024, out), FP8), jax.ShapeDtypeStruct((1, out), jnp.float32), backend)
        return "pallas_call" in str(jax.make_jaxpr(quant.fp8_dense_f32)(x, w))

    assert gemv(1, n) and not gemv(1, n - 64) and not gemv(2, n)
    assert not gemv(1, n, "xla") and gemv(4, 64, "pallas")

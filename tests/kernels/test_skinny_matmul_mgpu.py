"""The Mosaic GPU skinny matmul: run by Mosaic GPU's interpreter on the CPU (race detector on)
against the reference, its split plan checked on the CPU, lowered for CUDA on the CPU, and
refusing by name what it does not cover. On the GPU (benchmarks/gpu_tests.py runs tests/kernels)
the same tests run it compiled.

The interpreter's shared memory starts as NaN and its race detector flags a read that no barrier
orders after the TMA copy filling it, so "no race, equal to the reference" checks the
pipeline's slots and barriers as well as the arithmetic. Each interpreted case costs seconds.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The race detector's verdict has no public name in jax 0.11.2.
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax.experimental.pallas import mosaic_gpu as plgpu
from support.lowering import lower_for_cuda
from support.precision import tolerance

from jspec.kernels.backend import interpret_mode
from jspec.kernels.mgpu_tiles import MosaicUnsupported
from jspec.kernels.paged_tiles import TARGET_PROGRAMS
from jspec.kernels.ref import skinny_matmul_ref
from jspec.kernels.skinny_matmul_mgpu import (
    MIN_TILES_PER_SPLIT,
    mosaic_skinny_plan,
    mosaic_skinny_unsupported,
    skinny_matmul_mgpu,
)

RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)


@pytest.mark.parametrize(
    "M,K,N,tuning",
    [
        (1, 256, 128, dict(num_splits=2, num_stages=2)),  # split-K, one tile in flight ahead
        (5, 512, 256, dict(block_n=64, num_stages=3)),  # four strips, the slots reused twice
        (64, 128, 256, dict(block_n=256, num_stages=4)),  # every padded row real; more stages than tiles
    ],
)
def test_interpreted_kernel_matches_reference(M, K, N, tuning):
    rng = np.random.default_rng(M + K + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), jnp.bfloat16)
    interpreted = interpret_mode()
    got = skinny_matmul_mgpu(x, w, interpret=RACE_CHECKED if interpreted else None, **tuning)
    assert not (interpreted and get_races().races_found)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    # Both cast x to bf16, whose products are exact in f32; only the summation order differs.
    tol = tolerance(dots="exact")
    np.testing.assert_allclose(np.asarray(got), np.asarray(skinny_matmul_ref(x, w)), rtol=tol.rtol, atol=tol.atol)


def test_plan_fills_the_gpu_with_whole_splits():
    """Narrow N gets K splits up to TARGET_PROGRAMS programs, each split a whole number of tiles and
    never under MIN_TILES_PER_SPLIT of them; wide N gets none."""
    for K, N in [(4096, 6144), (4096, 4096), (14336, 4096), (576, 1536), (576, 960), (4096, 128256), (576, 49152)]:
        plan = mosaic_skinny_plan(K, N)
        tiles = K // 64
        assert plan.num_splits * plan.tiles_per_split == tiles
        assert plan.num_splits == 1 or plan.tiles_per_split >= MIN_TILES_PER_SPLIT
        strips = N // plan.block_n
        assert strips * plan.num_splits <= max(strips, TARGET_PROGRAMS)
    assert mosaic_skinny_plan(4096, 128256).num_splits == 1  # the LM head: strips enough
    assert mosaic_skinny_plan(576, 960).block_n == 64  # SmolLM2's fused QKV: 128 does not divide it
    assert mosaic_skinny_unsupported(1, 576, 960, jnp.bfloat16) is None
    assert mosaic_skinny_plan(14336, 4096).num_splits > 1  # Llama's down projection
    with pytest.raises(ValueError, match="must divide"):
        mosaic_skinny_plan(576, 1536, num_splits=4)  # 9 tiles
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_skinny_plan(4096, 4096, block_n=256, num_stages=8)


@pytest.mark.parametrize(
    "M,K,N,w_dtype",
    [
        (1, 4096, 6144, jnp.bfloat16),
        (16, 14336, 4096, jnp.bfloat16),
        (64, 4096, 128256, jnp.bfloat16),
        (1, 4096, 6144, jnp.float8_e4m3fn),  # FP8, one scale row
        (16, 14336, 4096, jnp.float8_e4m3fn),
        (1, 7168, 2048, "block"),  # FP8 with 128 x 128 block scales (DeepSeek-V3's)
    ],
)
def test_kernel_lowers_for_cuda(M, K, N, w_dtype):
    fn = functools.partial(skinny_matmul_mgpu, interpret=False)
    scale_rows = K // 128 if w_dtype == "block" else 1
    w_dtype = jnp.float8_e4m3fn if w_dtype == "block" else w_dtype
    specs = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), w_dtype))
    if w_dtype == jnp.float8_e4m3fn:
        specs += (jax.ShapeDtypeStruct((scale_rows, N), jnp.float32),)
    text = lower_for_cuda(fn, *specs).as_text()
    assert "custom_call @mosaic_gpu_v2" in text and "xla.gpu.triton" not in text


@pytest.mark.parametrize(
    "M,K,N,in_blocks,tuning",
    [
        (1, 256, 384, 1, {}),  # a scale per output channel, on the f32 sum
        (16, 512, 128, 1, dict(num_splits=2, block_n=64)),
        (3, 512, 256, 4, dict(num_splits=2, num_stages=3)),  # 128-row blocks (DeepSeek's): two tiles each
        (2, 256, 128, 4, dict(block_n=64, num_stages=2)),  # 64-row blocks: a scale row per tile
    ],
)
def test_interpreted_fp8_weight_matches_reference(M, K, N, in_blocks, tuning):
    """An e4m3 weight: its tiles upcast to bf16 in shared memory; one scale row applied to the
    f32 sum, block scales to each tile's product, their rows copied beside the tiles."""
    from kernels.test_fp8_kernels import fp8_weight

    w, scale = fp8_weight(K, N, in_blocks, seed=M + K)
    x = jnp.asarray(np.random.default_rng(M).standard_normal((M, K)), jnp.bfloat16)
    interpreted = interpret_mode()
    got = skinny_matmul_mgpu(x, w, scale, interpret=RACE_CHECKED if interpreted else None, **tuning)
    assert not (interpreted and get_races().races_found)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    want = skinny_matmul_ref(x, w, scale)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < tolerance(jnp.bfloat16).rel


@pytest.mark.parametrize(
    "M,K,N,dtype,feature",
    [
        (1, 256, 128, jnp.float32, "float32 weights"),
        (65, 256, 128, jnp.bfloat16, "65 rows"),
        (1, 300, 128, jnp.bfloat16, "K 300"),
        (1, 256, 200, jnp.bfloat16, "N 200 (a multiple of block_n 64)"),
    ],
)
def test_refuses_by_name(M, K, N, dtype, feature):
    """What the kernel lacks raises MosaicUnsupported naming it, before the kernel is traced;
    mosaic_skinny_unsupported() says the same without a call."""
    assert feature in mosaic_skinny_unsupported(M, K, N, dtype)
    x, w = jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), dtype)
    with pytest.raises(MosaicUnsupported, match=re.escape(feature)):
        jax.eval_shape(skinny_matmul_mgpu, x, w)


def test_refuses_fp8_block_scales_of_part_tiles_by_name():
    """Block scales over fewer input rows than a K tile stay with the Triton-backend GEMV."""
    feature = "FP8 block scales of 256/8 rows"
    assert feature in mosaic_skinny_unsupported(1, 256, 128, jnp.float8_e4m3fn, scale_rows=8)
    assert mosaic_skinny_unsupported(1, 256, 128, jnp.float8_e4m3fn, scale_rows=2) is None
    x, w = jax.ShapeDtypeStruct((1, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn)
    with pytest.raises(MosaicUnsupported, match=re.escape(feature)):
        jax.eval_shape(skinny_matmul_mgpu, x, w, jax.ShapeDtypeStruct((8, 128), jnp.float32))

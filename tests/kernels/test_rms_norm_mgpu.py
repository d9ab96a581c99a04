"""The Mosaic GPU add-then-RMSNorm kernel: run by Mosaic GPU's interpreter on the CPU (race
detector on) against the reference, lowered for CUDA on the CPU, refusing by name what it does
not cover; the layer's choice between it and the Triton-backend kernel. On the GPU
(benchmarks/gpu_tests.py runs tests/kernels) the same tests run it compiled.

The interpreter's shared memory starts as NaN and its race detector flags a read that no barrier
orders after the copy filling it, so a padded row's zeros and the copies' barrier are checked
too: a NaN in the padding would reach the sum of squares."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax.experimental.pallas import mosaic_gpu as plgpu
from support.lowering import lower_for_cuda

import jspec.kernels.backend
from jspec.kernels.backend import interpret_mode
from jspec.kernels.mgpu_tiles import MosaicUnsupported
from jspec.kernels.rms_norm import add_rms_norm_ref
from jspec.kernels.rms_norm_mgpu import add_rms_norm_mgpu, mosaic_add_rms_norm_unsupported
from jspec.layers import norm

RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)


@pytest.mark.parametrize(
    "T,H,dtype,y_dtype",
    [
        (3, 576, jnp.bfloat16, jnp.float32),  # SmolLM2's width: 9 lines in a 16-line buffer; a float32 delta
        (2, 4096, jnp.bfloat16, jnp.bfloat16),  # the 8B's: whole blocks, no padding
        (1, 128, jnp.float32, jnp.float32),  # float32 stream (the tests' engines on a GPU)
    ],
)
def test_interpreted_kernel_matches_reference(T, H, dtype, y_dtype):
    rng = np.random.default_rng(T * H)
    x = jnp.asarray(rng.standard_normal((T, H)) * 3, dtype)
    y = jnp.asarray(rng.standard_normal((T, H)) * 3, y_dtype)
    weight = jnp.asarray(1 + 0.2 * rng.standard_normal(H), dtype)
    interpreted = interpret_mode()
    got_sum, got_norm = add_rms_norm_mgpu(x, y, weight, eps=1e-6, interpret=RACE_CHECKED if interpreted else None)
    assert not (interpreted and get_races().races_found)
    ref_sum, ref_norm = add_rms_norm_ref(x, y, weight, 1e-6)
    assert got_sum.dtype == ref_sum.dtype and got_norm.dtype == ref_norm.dtype
    # The sum is one rounded add either way; the norm differs only in the order of its f32 sum
    # of squares, which moves the scale by ~1e-7 and a 16-bit result by at most one rounding.
    np.testing.assert_array_equal(np.asarray(got_sum), np.asarray(ref_sum))
    rtol = 1e-5 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(got_norm, np.float32), np.asarray(ref_norm, np.float32), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("T,H", [(1, 4096), (64, 576), (4096, 8192), (7, 16384)])
def test_kernel_lowers_for_cuda(T, H):
    rows = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    fn = functools.partial(add_rms_norm_mgpu, eps=1e-5, interpret=False)
    text = lower_for_cuda(fn, rows, jax.ShapeDtypeStruct((T, H), jnp.float32), jax.ShapeDtypeStruct((H,), jnp.bfloat16))
    assert "custom_call @mosaic_gpu_v2" in text.as_text() and "xla.gpu.triton" not in text.as_text()


def test_what_the_kernel_lacks_is_refused_by_name():
    assert mosaic_add_rms_norm_unsupported(4096, jnp.bfloat16, jnp.float32, jnp.bfloat16) is None
    assert "width 96" in mosaic_add_rms_norm_unsupported(96, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
    assert "width 16448" in mosaic_add_rms_norm_unsupported(16448, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
    assert "x in int8" in mosaic_add_rms_norm_unsupported(64, jnp.int8, jnp.bfloat16, jnp.bfloat16)
    x = jnp.zeros((2, 96), jnp.bfloat16)
    with pytest.raises(MosaicUnsupported, match="add-and-norm kernel does not support width 96"):
        add_rms_norm_mgpu(x, x, jnp.ones(96, jnp.bfloat16), eps=1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_mgpu(x, x[:, :64], jnp.ones(96, jnp.bfloat16), eps=1e-6)


@pytest.mark.parametrize("H,kernel", [(576, "mosaic_gpu_v2"), (96, "xla.gpu.triton")])
def test_the_layer_runs_the_mosaic_kernel_where_it_covers_the_width(monkeypatch, H, kernel):
    """JSPEC_ADD_RMS_NORM=mosaic on one GPU: the Mosaic kernel where it covers the width, the
    Triton-backend kernel elsewhere (traced as on a GPU, lowered for CUDA)."""
    monkeypatch.setenv(norm.ADD_RMS_NORM_ENV, "mosaic")
    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)
    monkeypatch.setattr(norm, "one_gpu", lambda: True)
    rows = jax.ShapeDtypeStruct((2, H), jnp.bfloat16)
    text = lower_for_cuda(lambda *a: norm.add_rms_norm(*a, 1e-6), rows, rows, jax.ShapeDtypeStruct((H,), jnp.bfloat16))
    assert kernel in text.as_text() and ("mosaic_gpu_v2" in text.as_text()) == (kernel == "mosaic_gpu_v2")

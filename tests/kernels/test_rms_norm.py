"""The add-then-RMSNorm kernel against its reference (interpret mode on the CPU, compiled on
the GPU), and the layer that picks between them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import lower_for_cuda
from support.models import TARGET
from support.precision import tolerance

from jspec.checkpoint.loader import init_random_params
from jspec.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from jspec.kvcache.pool import create_kv_pool
from jspec.layers import norm
from jspec.models.forward import forward
from jspec.worker.inputs import SeqChunk, build_forward_batch

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def operands(T, H, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x, y = (jnp.asarray(rng.standard_normal((T, H)) * 3, dtype) for _ in range(2))
    weight = jnp.asarray(1 + 0.2 * rng.standard_normal(H), dtype)
    return x, y, weight


@pytest.mark.parametrize(
    "T,H,dtype",
    [
        (1, 64, jnp.float32),
        (3, 576, jnp.bfloat16),  # a width that is not a power of two: the row's tail is masked
        (5, 96, jnp.float32),
        (2, 4096, jnp.bfloat16),
    ],
)
def test_add_rms_norm_matches_reference(T, H, dtype):
    x, y, weight = operands(T, H, dtype, seed=T * H)
    got_sum, got_norm = add_rms_norm(x, y, weight, eps=1e-6)
    ref_sum, ref_norm = add_rms_norm_ref(x, y, weight, 1e-6)
    assert got_sum.dtype == ref_sum.dtype and got_norm.dtype == ref_norm.dtype
    # The sum is one rounded add either way; the norm differs only in the order of its f32 sum
    # of squares, which moves the scale by ~1e-7 and a bf16 result by at most one rounding.
    np.testing.assert_array_equal(np.asarray(got_sum), np.asarray(ref_sum))
    rtol = 1e-5 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(got_norm, np.float32), np.asarray(ref_norm, np.float32), rtol=rtol, atol=rtol)


def test_a_float32_delta_is_rounded_to_the_stream_first():
    """y as a projection leaves it, float32, onto a bf16 stream: the kernel rounds it as the
    reference's add does, so the sum is bit for bit the reference's."""
    x, _, weight = operands(3, 576, jnp.bfloat16)
    y = jnp.asarray(np.random.default_rng(1).standard_normal((3, 576)) * 3, jnp.float32)
    got_sum, got_norm = add_rms_norm(x, y, weight, eps=1e-6)
    ref_sum, ref_norm = add_rms_norm_ref(x, y, weight, 1e-6)
    assert got_sum.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_sum), np.asarray(ref_sum))
    np.testing.assert_array_equal(np.asarray(ref_sum), np.asarray(x + y.astype(jnp.bfloat16)))
    np.testing.assert_allclose(
        np.asarray(got_norm, np.float32), np.asarray(ref_norm, np.float32), rtol=2**-7, atol=2**-7
    )


def test_add_rms_norm_refuses_mismatched_operands():
    x, y, weight = operands(2, 64, jnp.float32)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, y[:, :32], weight, eps=1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, y, weight[:32], eps=1e-6)


@pytest.mark.parametrize("T,H", [(1, 4096), (64, 576), (4096, 8192)])
def test_add_rms_norm_lowers_for_cuda(T, H):
    rows = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    fn = functools.partial(add_rms_norm, eps=1e-5, interpret=False)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, rows, rows, jax.ShapeDtypeStruct((H,), jnp.bfloat16)).as_text()


def test_the_layer_runs_the_kernel_on_one_gpu_only(monkeypatch):
    """With the setting on, the layer runs the kernel on a GPU and the reference elsewhere (the
    kernel would run interpreted); a setting it does not know is refused by name."""
    x, y, weight = operands(2, 64, jnp.float32)
    monkeypatch.setenv(norm.ADD_RMS_NORM_ENV, "pallas")
    text = jax.jit(lambda *a: norm.add_rms_norm(*a, 1e-6)).lower(x, y, weight).as_text()
    on_one_gpu = jax.default_backend() == "gpu" and jax.device_count() == 1
    assert ("add_rms_norm_64" in text) == on_one_gpu
    monkeypatch.setenv(norm.ADD_RMS_NORM_ENV, "xla")
    assert "add_rms_norm_64" not in jax.jit(lambda *a: norm.add_rms_norm(*a, 1e-6)).lower(x, y, weight).as_text()
    monkeypatch.setenv(norm.ADD_RMS_NORM_ENV, "triton")
    with pytest.raises(ValueError, match="JSPEC_ADD_RMS_NORM='triton'"):
        norm.add_rms_norm(x, y, weight, 1e-6)


def test_unset_the_kernel_follows_the_attention_backend(monkeypatch):
    """With JSPEC_ADD_RMS_NORM unset the add-and-norm is of the attention's kernel family
    (Mosaic GPU's under the Mosaic attention, so its programs hold no Triton-backend kernel);
    a value set wins over it."""
    monkeypatch.delenv(norm.ADD_RMS_NORM_ENV, raising=False)
    assert [norm.add_rms_norm_backend(b) for b in (None, "reference", "pallas", "mosaic")] == [
        "pallas",
        "pallas",
        "pallas",
        "mosaic",
    ]
    monkeypatch.setenv(norm.ADD_RMS_NORM_ENV, "pallas")
    assert norm.add_rms_norm_backend("mosaic") == "pallas"


def test_the_kernel_trains_with_the_references_gradient():
    """The trainers differentiate the draft layers (vmapped over the batch) through the GPU's
    kernel: Pallas alone cannot (its JVP rule fails on the program id), so the kernel's
    gradient is the reference's, here with the kernel interpreted on the CPU."""
    x, y, weight = operands(3, 96, jnp.float32)

    def loss(add_norm, x, y, w):
        s, normed = add_norm(x, y, w)
        return (normed * normed).sum() + 0.5 * s.sum()

    kernel = lambda x, y, w: norm.with_reference_vjp(add_rms_norm, x, y, w, 1e-6)  # noqa: E731
    reference = lambda x, y, w: add_rms_norm_ref(x, y, w, 1e-6)  # noqa: E731
    batched = jnp.stack([x, 2 * x])
    got = jax.vmap(jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2)), (0, None, None))(batched, y, weight)
    want = jax.vmap(jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2)), (0, None, None))(
        batched, y, weight
    )
    exact = tolerance(jnp.float32, dots="exact")  # the backward is the reference's: no dots in it
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=exact.rtol, atol=exact.atol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_forward_on_the_kernel_gives_the_references_logits(monkeypatch, dtype):
    """A Llama-family prefill with every add-and-norm on the kernel against the same with XLA's
    ops: on a GPU two different programs (equal up to the norms' summation order), on the CPU
    the same one."""
    params = init_random_params(TARGET, jax.random.key(0), dtype)
    batch, mode = build_forward_batch([SeqChunk(list(range(1, 12)), 0, [0, 1, 2])], page_size=4, num_pages=8)
    batch = batch._replace(logits_indices=np.arange(batch.tokens.shape[0], dtype=np.int32))

    def logits(backend):
        monkeypatch.setenv(norm.ADD_RMS_NORM_ENV, backend)
        kv = create_kv_pool(TARGET, 8, 4, dtype)
        run = jax.jit(lambda p, kv, b: forward(p, TARGET, kv, b, mode)[1].logits)  # traced afresh: reads the setting
        return np.asarray(run(params, kv, batch), np.float32)

    ref, got = logits("xla"), logits("pallas")
    # Both programs' dots name no precision (TF32 on a GPU), and each may pick its own GEMMs.
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < tolerance(dtype).rel

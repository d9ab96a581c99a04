"""The RoPE + K / V write kernel against its reference (interpret mode on the CPU, compiled on
the GPU), the reference against the model's own rotation and write, and the layer that picks
the kernel."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.lowering import lower_for_cuda
from support.models import TARGET
from support.precision import tolerance

from jspec.checkpoint.loader import init_random_params
from jspec.kernels.rope_kv import rope_kv_write, rope_kv_write_ref
from jspec.kvcache.pool import create_kv_pool, write_kv
from jspec.layers import attention
from jspec.layers.norm import rms_norm
from jspec.models import llama
from jspec.models.forward import forward
from jspec.models.rope import apply_rope
from jspec.worker.inputs import SeqChunk, build_forward_batch

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

LAYERS, PAGES, PAGE = 2, 6, 4


def operands(T, Hq, Hkv, D, cache_dtype, seed=0):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((T, (Hq + 2 * Hkv) * D)) * 2, jnp.float32)
    angles = rng.uniform(0, 2 * np.pi, (T, D // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    caches = [jnp.asarray(rng.standard_normal((LAYERS, PAGES, PAGE, Hkv, D)), cache_dtype) for _ in range(2)]
    # Every slot distinct, one of them the padding slot (pages * page size): it writes nothing.
    slots = jnp.asarray(rng.permutation(PAGES * PAGE + 1)[:T], jnp.int32).at[T // 2].set(PAGES * PAGE)
    return qkv, cos, sin, caches, slots


def norm_weights(D, dtype, seed=3):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(1 + 0.2 * rng.standard_normal(D), dtype) for _ in range(2))


@pytest.mark.parametrize(
    "T,Hq,Hkv,D,dtype,cache_dtype,normed",
    [
        (1, 9, 3, 64, jnp.bfloat16, jnp.bfloat16, False),  # SmolLM2's heads: counts that are not powers of two
        (5, 4, 2, 32, jnp.float32, jnp.float32, False),
        (3, 8, 8, 128, jnp.bfloat16, jnp.float32, False),  # a pool wider than the activations
        (7, 6, 1, 16, jnp.bfloat16, jnp.bfloat16, False),
        (3, 9, 3, 64, jnp.bfloat16, jnp.bfloat16, True),  # Qwen3's per-head q / k norms
        (5, 4, 2, 32, jnp.float32, jnp.float32, True),
    ],
)
def test_rope_kv_write_matches_reference(T, Hq, Hkv, D, dtype, cache_dtype, normed):
    qkv, cos, sin, (k_cache, v_cache), slots = operands(T, Hq, Hkv, D, cache_dtype, seed=T * D)
    dims = dict(num_heads=Hq, num_kv_heads=Hkv, dtype=dtype)
    norms = norm_weights(D, dtype) if normed else None
    got = rope_kv_write(qkv, cos, sin, k_cache, v_cache, 1, slots, norms, **dims)
    want = rope_kv_write_ref(qkv, cos, sin, k_cache, v_cache, 1, slots, norms, **dims)
    assert [g.dtype for g in got] == [w.dtype for w in want] and got[0].shape == (T, Hq, D)
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if dtype == jnp.float32:
            # The same f32 products and sums; a compiler may fuse a multiply and an add (one rounding
            # less), and the norm sums a head's squares in two halves.
            np.testing.assert_allclose(g, w, rtol=4e-6, atol=4e-6)
        elif normed:  # the halves' sum can move a bf16 result by one rounding
            np.testing.assert_allclose(g, w, rtol=2**-7, atol=2**-7)
        else:
            np.testing.assert_array_equal(g, w)
    # Only the written slots changed: the other layer, and every slot of this one not written, kept.
    untouched = np.ones((LAYERS, PAGES * PAGE), bool)
    untouched[1, [s for s in np.asarray(slots) if s < PAGES * PAGE]] = False
    for before, after in zip((k_cache, v_cache), got[1:]):
        flat = lambda a: np.asarray(a, np.float32).reshape(LAYERS, PAGES * PAGE, -1)  # noqa: E731
        np.testing.assert_array_equal(flat(after)[untouched], flat(before)[untouched])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("normed", [False, True])
def test_reference_is_the_models_rotation_and_write(dtype, normed):
    """rope_kv_write_ref equals what the model does without the kernel, bit for bit: the
    projection rounded to the activations' dtype, layers' rms_norm per head where the model
    norms q and k, models/rope.apply_rope, kvcache's write_kv."""
    T, Hq, Hkv, D = 5, 4, 2, 16
    qkv, cos, sin, (k_cache, v_cache), slots = operands(T, Hq, Hkv, D, dtype)
    q, k, v = (
        qkv.astype(dtype)[:, a:b].reshape(T, -1, D)
        for a, b in ((0, Hq * D), (Hq * D, (Hq + Hkv) * D), ((Hq + Hkv) * D, None))
    )
    norms = norm_weights(D, dtype) if normed else None
    if normed:
        q, k = rms_norm(q, norms[0], 1e-6), rms_norm(k, norms[1], 1e-6)
    want = (
        apply_rope(q, cos, sin),
        write_kv(k_cache, jnp.int32(1), slots, apply_rope(k, cos, sin)),
        write_kv(v_cache, jnp.int32(1), slots, v),
    )
    got = rope_kv_write_ref(
        qkv, cos, sin, k_cache, v_cache, jnp.int32(1), slots, norms, num_heads=Hq, num_kv_heads=Hkv, dtype=dtype
    )
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_rope_kv_write_refuses_what_it_does_not_do():
    qkv, cos, sin, (k_cache, v_cache), slots = operands(3, 4, 2, 16, jnp.float32)
    dims = dict(num_heads=4, num_kv_heads=2, dtype=jnp.float32)
    with pytest.raises(ValueError, match="full rotary"):  # a partial rotary's cos / sin are narrower
        rope_kv_write(qkv, cos[:, :4], sin[:, :4], k_cache, v_cache, 0, slots, **dims)
    with pytest.raises(ValueError, match="pool leaves"):
        rope_kv_write(qkv, cos, sin, k_cache[..., :1, :], v_cache[..., :1, :], 0, slots, **dims)
    with pytest.raises(ValueError, match="power of two"):
        rope_kv_write(
            qkv[:, : 8 * 24],
            cos[:, :12],
            sin[:, :12],
            *(c[..., :12].repeat(2, -1) for c in (k_cache, v_cache)),
            0,
            slots,
            **dims,
        )


@pytest.mark.parametrize(
    "T,Hq,Hkv,D,normed",
    [(1, 9, 3, 64, False), (64, 32, 8, 128, False), (4096, 32, 8, 128, False), (8, 32, 8, 128, True)],
)
def test_rope_kv_write_lowers_for_cuda(T, Hq, Hkv, D, normed):
    f = jax.ShapeDtypeStruct
    cache = f((4, 1000, 16, Hkv, D), jnp.bfloat16)
    fn = functools.partial(rope_kv_write, num_heads=Hq, num_kv_heads=Hkv, dtype=jnp.bfloat16, interpret=False)
    rows, angles = f((T, (Hq + 2 * Hkv) * D), jnp.float32), f((T, D // 2), jnp.float32)
    norms = (f((D,), jnp.bfloat16),) * 2 if normed else None
    text = lower_for_cuda(fn, rows, angles, angles, cache, cache, f((), jnp.int32), f((T,), jnp.int32), norms).as_text()
    assert "__gpu$xla.gpu.triton" in text and "output_operand_alias" in text  # the pool written in place


def run_forward(monkeypatch, setting, dtype, on_one_gpu=True, cfg=TARGET):
    """A prefill then a decode of two sequences through cfg on the Triton-backend attention
    (interpreted here), with the RoPE + write setting; the layer believes it runs on one GPU."""
    monkeypatch.setenv(attention.ROPE_KV_ENV, setting)
    monkeypatch.setattr(llama, "one_gpu", lambda: on_one_gpu)
    params = init_random_params(cfg, jax.random.key(0), dtype)
    kv = create_kv_pool(cfg, 8, 4, dtype)
    step = jax.jit(lambda p, kv, b, mode: forward(p, cfg, kv, b, mode), static_argnums=3)
    prompts = [list(range(1, 12)), list(range(30, 36))]
    batch, mode = build_forward_batch(
        [SeqChunk(prompts[0], 0, [0, 1, 2, 3]), SeqChunk(prompts[1], 0, [4, 5])], page_size=4, num_pages=8
    )
    text = step.lower(params, kv, batch, mode._replace(backend="pallas")).as_text()
    kv, first = step(params, kv, batch, mode._replace(backend="pallas"))
    batch, mode = build_forward_batch(
        [SeqChunk([7], 11, [0, 1, 2, 3]), SeqChunk([9], 6, [4, 5])], page_size=4, num_pages=8
    )
    kv, second = step(params, kv, batch, mode._replace(backend="pallas"))
    return text, [np.asarray(o.logits, np.float32) for o in (first, second)], kv


@pytest.mark.parametrize(
    "dtype,cfg",
    [
        (jnp.float32, TARGET),
        (jnp.bfloat16, TARGET),
        (jnp.bfloat16, dataclasses.replace(TARGET, qk_norm=True)),  # Qwen3's per-head norms, in the kernel
    ],
)
def test_the_forward_on_the_kernel_gives_xlas_logits_and_pool(monkeypatch, dtype, cfg):
    xla_text, want, want_kv = run_forward(monkeypatch, "xla", dtype, cfg=cfg)
    text, got, kv = run_forward(monkeypatch, "pallas", dtype, cfg=cfg)
    assert "rope_kv_write" in text and "rope_kv_write" not in xla_text
    # Each layer's input differs from XLA's by the roundings of the layers before it (the
    # per-head norms sum their squares in another order), so the pool and the logits are
    # compared as wholes.
    for g, w in zip(got + [np.asarray(x, np.float32) for x in kv], want + [np.asarray(x, np.float32) for x in want_kv]):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < tolerance(dtype).rel


def test_the_layer_keeps_xlas_ops_off_one_gpu_and_refuses_unknown_settings(monkeypatch):
    text, _, _ = run_forward(monkeypatch, "pallas", jnp.float32, on_one_gpu=False)
    assert "rope_kv_write" not in text
    monkeypatch.setenv(attention.ROPE_KV_ENV, "triton")
    with pytest.raises(ValueError, match="JSPEC_ROPE_KV='triton'"):
        attention.rope_kv_backend()

"""The Mosaic GPU paged decode kernel: run by Mosaic GPU's interpreter on the CPU against the
reference, lowered for CUDA on the CPU, and refusing by name what it does not cover; and the
engine's --attention-backend mosaic, which puts decode, extend and verify steps on the Mosaic GPU
kernels (this one and paged_extend_mgpu): its build's refusals, the model forward's lowering.

The interpreter simulates the GPU's memories, TMA copies, barriers and wgmmas, reads out of
bounds raise, fresh shared memory is NaN, and its race detector flags a read of shared memory
that no barrier orders after the copy filling it: so "no NaN, no race, equal to the reference"
on the poisoned problems of test_kernels.py checks the pipeline's synchronisation as well as
its arithmetic. Each interpreted case costs seconds (mostly tracing the interpreter), so the
shapes are small and the cases few. Lowering reaches further than the Triton kernels' (see
test_kernels_lowering.py): Mosaic GPU infers its register layouts and lowers its dialect in
Python, so layout, tiling, wgmma-shape and shared-memory-size errors fail here; PTX and the
cubin are built only by XLA's compiler on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The race detector's verdict has no public name in jax 0.11.2.
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels.test_kernels import LAYER, SM_SCALE, paged_problem, rel_err
from support.lowering import lower_for_cuda
from support.precision import tolerance

from jspec.kernels.backend import interpret_mode
from jspec.kernels.paged_decode import decode_plan
from jspec.kernels.paged_decode_mgpu import (
    MosaicUnsupported,
    mosaic_decode_plan,
    mosaic_decode_unsupported,
    paged_decode_mgpu,
)
from jspec.kernels.ref import paged_decode_ref

BF16, I32 = jnp.bfloat16, jnp.int32
RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)

# (page_size, group, head_dim, tuning): a tile of four pages written out directly (one split);
# tiles of eight pages, three in flight, over three splits (the merge path); tiles inside a
# 128-token page, over two splits, with the log-sum-exp. GQA groups 4, 8 and 1.
CASES = [
    pytest.param(16, 4, 64, dict(num_splits=1), id="s16-g4-one_split"),
    pytest.param(8, 8, 128, dict(num_splits=3, num_stages=3), id="s8-g8-d128-three_splits"),
    pytest.param(128, 1, 64, dict(num_splits=2, return_lse=True), id="s128-g1-tile_in_page-lse"),
]


@pytest.mark.parametrize("page_size,group,head_dim,tuning", CASES)
def test_interpreted_kernel_matches_reference(page_size, group, head_dim, tuning):
    rng = np.random.default_rng(page_size + group)
    num_kv_heads = 2
    # Empty, one token, exactly two pages, just past them, and several tiles.
    seq_lens = np.array([0, 1, 2 * page_size, 2 * page_size + 3, 200], np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim))
    q, k, v = (jnp.asarray(x, BF16) for x in (q, k, v))
    check_against_reference(q, k, v, seq_lens, tables, tuning)


def check_against_reference(q, k, v, seq_lens, tables, tuning):
    """The kernel (interpreted with the race detector on the CPU, compiled on the GPU, as
    benchmarks/gpu_tests.py runs this file there) against the reference, within bf16's tolerance;
    the empty sequence's row all zeros (its log-sum-exp -inf)."""
    args = (q, k, v, jnp.array([LAYER], I32), jnp.asarray(seq_lens), jnp.asarray(tables))
    tuning = dict(tuning)
    return_lse = tuning.pop("return_lse", False)
    interpreted = interpret_mode()
    got = paged_decode_mgpu(
        *args,
        sm_scale=SM_SCALE,
        min_split_tokens=16,
        return_lse=return_lse,
        interpret=RACE_CHECKED if interpreted else None,
        **tuning,
    )
    want = paged_decode_ref(*args, sm_scale=SM_SCALE, return_lse=return_lse)
    assert not (interpreted and get_races().races_found)
    tol = tolerance(BF16)
    if return_lse:
        (got, lse), (want, want_lse) = got, want
        np.testing.assert_allclose(lse, want_lse, rtol=tol.rtol, atol=tol.lse_atol)
        assert np.all(np.isneginf(lse[0]))
    else:
        assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    assert rel_err(got, np.asarray(want, np.float32)) < tol.rel
    assert not np.any(got[0])  # seq_len 0 -> zeros


# (page_size, head_dim, tuning): an FP8 pool (e4m3 bytes, as the engine stores it), upcast to f16
# in shared memory: tiles of four pages over two splits; pages of a whole tile, three in flight.
FP8_CASES = [
    pytest.param(16, 64, dict(num_splits=2), id="s16-d64-two_splits"),
    pytest.param(64, 128, dict(num_splits=1, num_stages=3, return_lse=True), id="s64-d128-lse"),
]


@pytest.mark.parametrize("page_size,head_dim,tuning", FP8_CASES)
def test_interpreted_fp8_kv_matches_reference(page_size, head_dim, tuning):
    from kernels.test_fp8_kernels import fp8_paged_problem

    seq_lens = np.array([0, 1, 2 * page_size + 3, 200], np.int32)
    k8, v8, _, _, tables = fp8_paged_problem(page_size, seq_lens, page_size, head_dim=head_dim)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((len(seq_lens), 8, head_dim)), BF16)
    check_against_reference(q, jnp.asarray(k8), jnp.asarray(v8), seq_lens, tables, tuning)


# (page_size, window, softcap, sinks, tuning): a window starting inside a tile, over splits (each
# sequence's splits cover its window only); the same with a soft-cap and sinks, one split; sinks
# over three splits with the log-sum-exp (the merge must count them once).
FEATURE_CASES = [
    pytest.param(16, 37, None, False, dict(num_splits=2), id="s16-window37-two_splits"),
    pytest.param(8, 70, 5.0, True, dict(num_splits=1), id="s8-window70-softcap-sinks"),
    pytest.param(16, None, None, True, dict(num_splits=3, return_lse=True), id="s16-sinks-three_splits-lse"),
]


@pytest.mark.parametrize("page_size,window,softcap,sinks,tuning", FEATURE_CASES)
def test_interpreted_windows_softcaps_and_sinks_match_reference(page_size, window, softcap, sinks, tuning):
    rng = np.random.default_rng(page_size + (window or 0))
    num_kv_heads, group, head_dim = 2, 4, 64
    # Empty, shorter than the window, just past it, and far past it.
    seq_lens = np.array([0, 5, (window or 64) + 3, 200], np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim))
    q, k, v = (jnp.asarray(x, BF16) for x in (q, k, v))
    args = (q, k, v, jnp.array([LAYER], I32), jnp.asarray(seq_lens), jnp.asarray(tables))
    features = dict(
        window=None if window is None else jnp.array([window], I32),
        logit_softcap=softcap,
        sinks=jnp.asarray(rng.standard_normal(num_kv_heads * group), jnp.float32) if sinks else None,
    )
    tuning = dict(tuning)
    return_lse = tuning.pop("return_lse", False)
    interpreted = interpret_mode()
    got = paged_decode_mgpu(
        *args,
        sm_scale=SM_SCALE,
        min_split_tokens=16,
        return_lse=return_lse,
        interpret=RACE_CHECKED if interpreted else None,
        **features,
        **tuning,
    )
    want = paged_decode_ref(*args, sm_scale=SM_SCALE, return_lse=return_lse, **features)
    assert not (interpreted and get_races().races_found)
    tol = tolerance(BF16)
    if return_lse:
        (got, lse), (want, want_lse) = got, want
        np.testing.assert_allclose(lse, want_lse, rtol=tol.rtol, atol=tol.lse_atol)
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    assert rel_err(got, np.asarray(want, np.float32)) < tol.rel


def cache_specs(batch, ctx, page_size, num_kv_heads, head_dim, dtype=BF16):
    cache = jax.ShapeDtypeStruct((4, batch * ctx // page_size + 1, page_size, num_kv_heads, head_dim), dtype)
    lens, tables = jax.ShapeDtypeStruct((batch,), I32), jax.ShapeDtypeStruct((batch, ctx // page_size), I32)
    return cache, cache, jax.ShapeDtypeStruct((), I32), lens, tables


@pytest.mark.parametrize(
    "batch,ctx,page_size,num_q_heads,num_kv_heads,head_dim,tuning",
    [
        (32, 4096, 16, 32, 8, 128, {}),  # Llama-3.1-8B, one split: the output written directly
        (1, 4096, 16, 32, 8, 128, dict(return_lse=True)),  # split-K
        (8, 4096, 256, 16, 2, 256, dict(num_stages=1)),  # head_dim 256, tiles inside a page
        (32, 4096, 16, 32, 8, 128, dict(kv=jnp.uint8)),  # the 8B shape over an FP8 pool
        (4, 4096, 64, 16, 2, 64, dict(kv=jnp.uint8, return_lse=True)),
    ],
)
def test_kernel_lowers_for_cuda(batch, ctx, page_size, num_q_heads, num_kv_heads, head_dim, tuning):
    tuning = dict(tuning)
    kv = tuning.pop("kv", BF16)
    q = jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), BF16)
    fn = functools.partial(paged_decode_mgpu, sm_scale=head_dim**-0.5, interpret=False, **tuning)
    text = lower_for_cuda(fn, q, *cache_specs(batch, ctx, page_size, num_kv_heads, head_dim, kv)).as_text()
    assert "custom_call @mosaic_gpu_v2" in text and "xla.gpu.triton" not in text


def test_kernel_with_window_softcap_and_sinks_lowers_for_cuda():
    """gpt-oss-like attention (a window, sinks) with Gemma 2's soft-cap, over split-K."""
    q = jax.ShapeDtypeStruct((4, 32, 64), BF16)
    window, sinks = jax.ShapeDtypeStruct((1,), I32), jax.ShapeDtypeStruct((32,), jnp.float32)

    def fn(q, k, v, layer, lens, tables, window, sinks):
        return paged_decode_mgpu(
            q,
            k,
            v,
            layer,
            lens,
            tables,
            sm_scale=0.125,
            window=window,
            logit_softcap=30.0,
            sinks=sinks,
            interpret=False,
        )

    text = lower_for_cuda(fn, q, *cache_specs(4, 4096, 16, 8, 64), window, sinks).as_text()
    assert "custom_call @mosaic_gpu_v2" in text and "xla.gpu.triton" not in text


@pytest.mark.parametrize(
    "change,feature",
    [
        (dict(dtype=jnp.float32), "float32 KV"),
        (dict(page_size=4), "page size 4"),
        (dict(head_dim=96), "head_dim 96"),
        (dict(num_warps=8), "num_warps 8"),
    ],
)
def test_refuses_by_name(change, feature):
    """What the kernel lacks raises MosaicUnsupported naming it, before any tracing of the kernel;
    mosaic_decode_unsupported() says the same without a call."""
    change = dict(change)
    page_size, head_dim, dtype = change.pop("page_size", 16), change.pop("head_dim", 64), change.pop("dtype", BF16)
    q = jax.ShapeDtypeStruct((2, 8, head_dim), BF16)
    cache = jax.ShapeDtypeStruct((1, 9, page_size, 2, head_dim), dtype)
    call = functools.partial(paged_decode_mgpu, sm_scale=0.1, **change)
    specs = (q, cache, cache, jax.ShapeDtypeStruct((), I32), jax.ShapeDtypeStruct((2,), I32))
    with pytest.raises(MosaicUnsupported, match=feature):
        jax.eval_shape(lambda *a: call(*a), *specs, jax.ShapeDtypeStruct((2, 4), I32))
    unsupported = mosaic_decode_unsupported(cache.shape, dtype, 8, **change)
    assert feature in unsupported
    assert mosaic_decode_unsupported(cache.shape[:2] + (16, 2, 64), BF16, 8) is None


@pytest.mark.parametrize("batch,table_ctx", [(1, 4096), (32, 4096), (4, 8192)])
def test_plan_splits_as_the_triton_kernel(batch, table_ctx):
    """The same split-K partition as the Triton-backend kernel at its default tile, so either
    one's partials merge alike and a swap changes no launch count."""
    cache_shape = (32, 1000, 16, 8, 128)
    mosaic = mosaic_decode_plan(batch, 32, cache_shape, table_ctx // 16, sm_scale=0.1)
    triton = decode_plan(batch, 32, cache_shape, table_ctx // 16)
    assert (mosaic.num_splits, mosaic.min_split_len, mosaic.block_n) == (
        triton.num_splits,
        triton.min_split_len,
        triton.block_n,
    )
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_decode_plan(batch, 32, (32, 1000, 16, 8, 256), table_ctx // 16, sm_scale=0.1, block_n=256, num_stages=2)


def model(**fields):
    from jspec.config.model import ModelConfig

    base = dict(
        family="llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
    )
    return ModelConfig(**{**base, **fields})


def speculative(**fields):
    from jspec.config.spec import SpecConfig

    return SpecConfig(**fields)


@pytest.mark.parametrize(
    "fields,settings,feature",
    [
        ({}, dict(page_size=4), "page size 4"),
        (dict(head_dim=80), {}, "head_dim 80"),
        # 260 draft tokens verify as a tree of 512: past the extend kernel's mask words.
        ({}, dict(speculative=dict(num_steps=5, eagle_topk=8, num_draft_tokens=260)), "tree mask over 512 tokens"),
    ],
)
def test_engine_build_refuses_what_the_mosaic_backend_lacks(fields, settings, feature):
    from jspec.config.engine import EngineConfig
    from jspec.engine.build import check_attention_backend

    settings = dict(settings)
    if "speculative" in settings:
        settings["speculative"] = speculative(**settings["speculative"])
    with pytest.raises(MosaicUnsupported, match=feature):
        check_attention_backend(EngineConfig(attention_backend="mosaic", **settings), model(**fields), BF16)
    check_attention_backend(EngineConfig(attention_backend="pallas", **settings), model(**fields), BF16)


def test_the_build_log_names_each_layer_steps_kernel(monkeypatch):
    """On one GPU the engine logs what runs each layer step, read from the same gates the
    layers use: the Triton-backend family under the default attention, the Mosaic add-and-norm
    and XLA's RoPE under the Mosaic one, the environment's switches, an FP8 pool; off one GPU
    nothing (XLA's ops and the jnp attention run everything)."""
    import jspec.engine.build as build
    import jspec.models.llama as llama
    from jspec.config.engine import EngineConfig

    for env in ("JSPEC_ROPE_KV", "JSPEC_ADD_RMS_NORM", "JSPEC_SKINNY_MATMUL"):
        monkeypatch.delenv(env, raising=False)
    for module in (build, llama):
        monkeypatch.setattr(module, "one_gpu", lambda: False)
    assert build.layer_kernels(EngineConfig(attention_backend="pallas"), model(), BF16) is None
    for module in (build, llama):
        monkeypatch.setattr(module, "one_gpu", lambda: True)
    triton = build.layer_kernels(EngineConfig(attention_backend="pallas"), model(), BF16)
    assert triton["attention"] == "the Triton-backend kernels"
    assert triton["add-and-norm"] == "the Triton-backend kernel"
    assert triton["RoPE and K / V write"] == "one Triton-backend kernel"
    assert triton["projections"].startswith("XLA's dot, weights under 8,388,608 elements stored [out, in]")
    # Where the [out, in] layout does not apply, the default keeps the [in, out] weights.
    unrolled_stack = build.layer_kernels(
        EngineConfig(attention_backend="pallas", layer_loop="unrolled_stack"), model(), BF16
    )
    assert unrolled_stack["projections"].startswith("XLA's dot, one-row products of weights of 8,388,608 elements")
    mosaic = build.layer_kernels(EngineConfig(attention_backend="mosaic"), model(), BF16)
    assert mosaic["attention"] == "the Mosaic GPU kernels" and mosaic["add-and-norm"].startswith(
        "the Mosaic GPU kernel"
    )
    assert mosaic["RoPE and K / V write"] == "XLA's ops"
    fp8_pool = build.layer_kernels(EngineConfig(attention_backend="pallas", kv_cache_dtype="fp8_e4m3"), model(), BF16)
    assert fp8_pool["RoPE and K / V write"] == "XLA's ops"
    assert (
        "FP8"
        in build.layer_kernels(EngineConfig(attention_backend="pallas"), model(), BF16, fp8_weights=True)["projections"]
    )
    monkeypatch.setenv("JSPEC_ROPE_KV", "xla")
    monkeypatch.setenv("JSPEC_SKINNY_MATMUL", "xla")
    monkeypatch.setenv("JSPEC_ADD_RMS_NORM", "xla")
    assert build.layer_kernels(EngineConfig(attention_backend="pallas"), model(), BF16) == {
        "attention": "the Triton-backend kernels",
        "add-and-norm": "XLA's ops",
        "RoPE and K / V write": "XLA's ops",
        "projections": "XLA's dot",
    }


def test_engine_build_takes_a_plain_bf16_model_and_refuses_a_float32_one():
    from jspec.config.engine import EngineConfig
    from jspec.engine.build import check_attention_backend

    config = EngineConfig(attention_backend="mosaic")
    check_attention_backend(config, model(), BF16)
    # An FP8 KV cache: both kernels upcast its tiles.
    check_attention_backend(EngineConfig(attention_backend="mosaic", kv_cache_dtype="fp8_e4m3"), model(), BF16)
    # Windows, soft-caps and sinks: both kernels take them.
    check_attention_backend(config, model(family="mistral", sliding_windows=(128, 0)), BF16)
    check_attention_backend(config, model(family="gemma2", attn_logit_softcap=50.0), BF16)
    check_attention_backend(config, model(attention_sinks=True, sliding_windows=(128, 0)), BF16)
    tree_of_64 = EngineConfig(
        attention_backend="mosaic", speculative=speculative(num_steps=5, eagle_topk=4, num_draft_tokens=64)
    )
    check_attention_backend(tree_of_64, model(), BF16)
    with pytest.raises(MosaicUnsupported, match="float32 KV"):
        check_attention_backend(config, model(), jnp.float32)


@pytest.mark.slow
def test_engine_on_the_mosaic_backend_gives_the_reference_backends_tokens():
    """--attention-backend mosaic through the whole engine (the kernels interpreted on the CPU):
    gpt-oss's attention (sinks, a window on every other layer, narrower than the first prompt)
    on a bf16 model gives the jnp reference backend's greedy tokens."""
    from functools import partial

    from speculative.test_spec_families import FAMILIES, weight_std
    from support.models import TARGET

    import jspec
    from jspec.checkpoint.loader import init_random_params

    family = {k: v[:2] if k == "sliding_windows" else v for k, v in FAMILIES["gpt_oss_attention"].items()}
    cfg = dataclasses.replace(
        TARGET, hidden_size=128, intermediate_size=128, head_dim=64, num_layers=2, **family
    )  # fmt: skip
    params = init_random_params(cfg, jax.random.key(3), BF16, std=partial(weight_std, cfg))
    prompts = [list(range(3, 23)), list(range(30, 37))]
    tokens = {}
    for backend in ("reference", "mosaic"):
        engine = jspec.Engine(
            (cfg, params),
            page_size=16,
            max_total_tokens=16 * 20,
            max_running_requests=2,
            precompile_bs_paddings=[2],
            attention_backend=backend,
            disable_overlap_schedule=True,
        )
        out = jspec.generate((cfg, params), prompts, max_new_tokens=5, ignore_eos=True, engine=engine)
        tokens[backend] = [o.token_ids for o in out]
    assert tokens["mosaic"] == tokens["reference"]


@pytest.mark.parametrize(
    "step,fields",
    [
        ("decode", {}),
        ("extend", {}),
        ("verify", {}),
        # gpt-oss's attention: sinks, and windows on every other layer.
        ("decode", dict(attention_sinks=True, sliding_windows=(128, 0))),
        ("verify", dict(attention_sinks=True, sliding_windows=(128, 0))),
        # An FP8 KV pool (e4m3 bytes).
        ("decode", dict(kv=jnp.uint8)),
        ("verify", dict(kv=jnp.uint8)),
    ],
)
def test_model_forward_with_the_mosaic_backend_lowers_for_cuda(step, fields, monkeypatch):
    """--attention-backend mosaic: decode, extend (causal) and verify (a tree mask) steps all
    call the Mosaic GPU kernels, none the Triton-backend ones: the layers' add-and-norm, a
    kernel on one GPU, is Mosaic GPU's too unless JSPEC_ADD_RMS_NORM says otherwise."""
    import jspec.kernels.backend
    import jspec.layers.norm
    from jspec.checkpoint.loader import param_shapes
    from jspec.kvcache.pool import KVPool
    from jspec.layers.batch import AttentionMode, ForwardBatch
    from jspec.models.forward import forward

    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)  # kernels as on the GPU
    monkeypatch.setattr(jspec.layers.norm, "one_gpu", lambda: True)  # the add-and-norm kernel, as on one GPU
    monkeypatch.delenv("JSPEC_ADD_RMS_NORM", raising=False)
    fields = dict(fields)
    kv = fields.pop("kv", BF16)
    cfg = model(**fields)
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, BF16), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )
    decode_only = step == "decode"
    B, Q, S, pages = 8, 1 if decode_only else 4, 16, 16
    T = B * Q
    cache = jax.ShapeDtypeStruct((cfg.num_layers, B * pages + 1, S, cfg.num_kv_heads, cfg.head_dim), kv)
    batch = ForwardBatch(
        *(jax.ShapeDtypeStruct((n,), I32) for n in (T, T, T, B)),
        jax.ShapeDtypeStruct((B, pages), I32),
        jax.ShapeDtypeStruct((B + 1,), I32),
        jax.ShapeDtypeStruct((B,), I32),
    )
    mode = AttentionMode(decode_only, Q, "mosaic")
    mask = jax.ShapeDtypeStruct((B, Q, Q), jnp.bool_) if step == "verify" else None
    fn = lambda p, kv, b, m: forward(p, cfg, kv, b, mode, mask=m)[1].logits  # noqa: E731
    text = lower_for_cuda(fn, params, KVPool(cache, cache), batch, mask).as_text()
    assert "mosaic_gpu_v2" in text and "add_rms_norm_mgpu" in text
    assert "xla.gpu.triton" not in text

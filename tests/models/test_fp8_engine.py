"""FP8 in the engine: --quantization fp8, FP8 checkpoints under tensor parallelism, the FP8 KV
cache (its checkpoint scales, speculative greedy equality, prefix caching, PD hand-over), the
features refused by name, and the bf16 decode step with both lowered for an H200."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.models import PROMPTS, SPEC, eagle_draft, tiny_model

import jspec
from jspec.checkpoint.loader import load_model
from jspec.checkpoint.tiny import make_tiny_model
from jspec.disaggregation import kv_io
from jspec.disaggregation.prefill import PrefillEngine
from jspec.layers.quant import Fp8Weight, quantize_params
from jspec.testing.fp8 import write_fp8_checkpoint
from jspec.worker.inputs import decode_inputs

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

# Every decode pads to 4 rows: one decode program however the rows finish.
ENGINE = dict(
    page_size=4,
    max_total_tokens=1020,
    max_running_requests=4,
    precompile_bs_paddings=[4],
    attention_backend="reference",
)


def greedy(model, prompts=PROMPTS, n=10, **kw):
    engine = jspec.Engine(model, **{**ENGINE, **kw})
    outs = engine.generate(prompts, jspec.SamplingParams(max_new_tokens=n, ignore_eos=True))
    engine.check_idle_no_leaks()
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "fp8", seed=11, num_heads=8, num_kv_heads=2, context=256)


def test_quantization_fp8_equals_its_dequantised_weights(tiny):
    """--quantization fp8 runs the per-channel FP8 weights: the same tokens as f32 weights
    holding exactly their dequantised values."""
    got, engine = greedy(tiny, quantization="fp8")
    layers = engine.worker.params["layers"]
    wqkv = (layers[0] if isinstance(layers, list) else layers)["wqkv"]  # a GPU keeps per-layer arrays
    assert isinstance(wqkv, Fp8Weight) and wqkv.in_blocks == 1
    q = quantize_params(tiny.params, "fp8")
    deq = {n: a.dequantize() if isinstance(a, Fp8Weight) else a for n, a in q["layers"].items()}
    want, _ = greedy((tiny.cfg, {**q, "layers": deq}))
    assert got == want


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    src = make_tiny_model(str(root / "src"), seed=11, num_heads=8, num_kv_heads=2, max_position_embeddings=256)
    return {
        layout: write_fp8_checkpoint(src, root / layout, layout, block=(32, 32), kv_scales=(0.02, 0.01))
        for layout in ("ct_channel_dynamic", "fp8_block")
    }


@pytest.mark.parametrize(
    "layout,tp,kv",
    [
        ("ct_channel_dynamic", 2, "fp8_e4m3"),  # KV heads split, the FP8 pool (checkpoint scales) with them
        ("fp8_block", 4, "auto"),  # KV heads repeated, block scales blocked with their columns
    ],
)
def test_fp8_checkpoint_tp_greedy_equals_one_device(fp8_checkpoints, layout, tp, kv):
    """Scales are blocked and sharded with their weights: TP gives one device's tokens."""
    model = jspec.load(fp8_checkpoints[layout], dtype="float32")
    ref, _ = greedy(model, kv_cache_dtype=kv)
    got, engine = greedy(model, kv_cache_dtype=kv, tp_size=tp)
    assert got == ref
    assert len(engine.worker.params["layers"]["wqkv"].scale.sharding.device_set) == tp
    assert engine.worker.state.target_kv.k.sharding.spec[3] == "tensor"


def test_fp8_kv_cache_uses_the_checkpoint_scales(fp8_checkpoints):
    """The pool is FP8 and holds K / k_scale; decoding over it stays close to the f32 cache's
    logits (q carries k_scale, the output v_scale)."""
    path = fp8_checkpoints["ct_channel_dynamic"]
    cfg, params = load_model(path)
    np.testing.assert_array_equal(params["kv_scale"], np.float32([[0.02, 0.01]] * cfg.num_layers))
    prompt = [list(range(3, 40))]
    out = {}
    for kv in ("auto", "fp8_e4m3"):
        # One 64-token chunk holds the prompt: a request's first prompt logprobs compile the
        # prompt-logprob prefill of every token bucket, two here instead of four.
        engine = jspec.Engine((cfg, params), **ENGINE, kv_cache_dtype=kv, chunked_prefill_size=64)
        sp = jspec.SamplingParams(max_new_tokens=4, ignore_eos=True, logprob_start_len=0, return_logprob=True)
        (o,) = engine.generate(prompt, sp)
        out[kv] = (np.array(o.input_logprobs[1:], np.float64), engine.worker.state.target_kv.k)
    (lp32, k32), (lp8, k8) = out["auto"], out["fp8_e4m3"]
    assert k8.dtype == jnp.uint8 and k32.dtype == jnp.float32  # e4m3 stored as its bytes
    # Stored K is K / 0.02: 50 times the f32 pool's values within e4m3's rounding, saturated at 448
    # (in layer 0, whose K the FP8 cache does not change: later layers' inputs went through it).
    k32, k8 = np.asarray(k32)[0], np.asarray(k8)[0].view(jnp.float8_e4m3fn)
    used = np.abs(k32) > 0.1
    want = np.clip(k32[used] * 50, -448, 448)
    got = k8.astype(np.float32)[used]
    bad = np.abs(got / want - 1) > 2**-3
    assert not np.any(bad), (got[bad][:5], want[bad][:5])
    assert np.max(np.abs(lp8 - lp32)) < 0.05 * np.max(np.abs(lp32))


def test_fp8_kv_speculative_greedy_equals_plain_with_prefix_cache(tiny):
    """Within the FP8 KV setting, EAGLE-3 (its draft head in the model's dtype) gives plain
    greedy decoding's tokens; prompts sharing a prefix reuse cached FP8 pages."""
    plain, _ = greedy(tiny, PROMPTS, kv_cache_dtype="fp8_e4m3", disable_radix_cache=True)
    spec, engine = greedy(tiny, PROMPTS, kv_cache_dtype="fp8_e4m3", speculative=SPEC, draft=eagle_draft(tiny, seed=5))
    assert spec == plain
    dtypes = [d for kind, _, d in kv_io.layout(engine.worker.state) if kind == "paged"]
    assert dtypes == ["uint8"] * 2 + ["float32"] * 2  # the target's pool FP8 (its bytes), the draft's not
    # A prompt extending a finished one reuses its cached FP8 pages and decodes as without them.
    engine.generate(PROMPTS[1:2], jspec.SamplingParams(max_new_tokens=10, ignore_eos=True))
    again = [PROMPTS[1] + plain[1] + [5, 6, 7]]
    assert engine.prefix_cache.match_prefix(again[0]).num_tokens >= 64
    cached = engine.generate(again, jspec.SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    assert cached == greedy(tiny, again, kv_cache_dtype="fp8_e4m3", disable_radix_cache=True)[0][0]


def test_fp8_kv_pd_round_trip_is_exact(tiny):
    """A prefilled request's FP8 KV read out of a prefill engine and written into a decode
    engine's pool (another page size) comes back bit for bit."""
    src = PrefillEngine(tiny, **{**ENGINE, "max_total_tokens": 252}, kv_cache_dtype="fp8_e4m3")
    src.add_prefill("a", list(range(3, 40)), jspec.SamplingParams(), seed=5)
    while src.has_work():
        src.step()
    (h,) = src.handoffs
    out = [np.asarray(a) for a in h.arrays]
    out = [a[:, : h.num_tokens] if i < h.num_paged else a for i, a in enumerate(out)]
    assert out[0].dtype == np.uint8
    dst_engine = jspec.Engine(tiny, **{**ENGINE, "page_size": 8, "max_total_tokens": 504}, kv_cache_dtype="fp8_e4m3")
    dst, kv = dst_engine.worker, dst_engine.scheduler.kv
    pages, slot = kv.allocator.alloc(6), kv.alloc_slot()
    staged = kv_io.stage_request(kv_io.layout(dst.state), out, h.num_tokens, to_device=True)
    dst.state = kv_io.write_request(dst.state, staged, pages, 8, h.num_tokens, slot)
    back = [np.asarray(a) for a in kv_io.extract_request(dst.state, pages, 8, h.num_tokens, slot)]
    for i, (a, b) in enumerate(zip(out, back)):
        b = b[:, : h.num_tokens] if i < h.num_paged else b
        np.testing.assert_array_equal(a, b)
    # A bf16/f32-KV decode engine does not take an FP8 engine's requests.
    plain = jspec.Engine(tiny, **{**ENGINE, "page_size": 8, "max_total_tokens": 504})
    with pytest.raises(ValueError, match="do not match"):
        kv_io.stage_request(kv_io.layout(plain.worker.state), out, h.num_tokens, to_device=False)


def test_fp8_refusals(tiny, fp8_checkpoints, tmp_path):
    with pytest.raises(NotImplementedError, match="LoRA adapters over FP8"):
        jspec.Engine(tiny, **ENGINE, quantization="fp8", enable_lora=True)
    block = jspec.load(fp8_checkpoints["fp8_block"], dtype="float32")
    with pytest.raises(NotImplementedError, match="w8a8 takes per-tensor or per-channel"):
        jspec.Engine(block, **ENGINE, fp8_gemm_backend="w8a8")
    with pytest.raises(ValueError, match="unknown quantization"):
        jspec.Engine(tiny, **ENGINE, quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        jspec.Engine(tiny, **ENGINE, kv_cache_dtype="fp8_e5m2")
    moe = jspec.load(make_tiny_model(str(tmp_path / "moe"), "qwen3_moe", seed=1), dtype="float32")
    with pytest.raises(NotImplementedError, match="MoE experts"):
        jspec.Engine(moe, **ENGINE, quantization="fp8")


@pytest.mark.parametrize("scan,gemm", [(True, "xla"), (False, "pallas"), (False, "mosaic"), (True, "w8a8")])
def test_fp8_decode_step_lowers_for_cuda(tmp_path, monkeypatch, scan, gemm):
    """The bf16 decode step with FP8 weights (stacked under the scan through XLA's dot, or per
    layer through the Pallas GEMV, Triton's or Mosaic GPU's) and an FP8 KV pool lowers for an
    H200, kernels compiled; the weights enter the step FP8."""
    from support.lowering import lower_for_cuda

    import jspec.kernels.backend
    import jspec.layers.quant
    from jspec.steps.plain import plain_decode_step

    path = make_tiny_model(str(tmp_path / "bf16"), seed=7, max_position_embeddings=512, dtype="bfloat16")
    engine = jspec.Engine(
        jspec.load(path, dtype=jnp.bfloat16),
        page_size=16,
        max_total_tokens=1008,
        quantization="fp8",
        kv_cache_dtype="fp8_e4m3",
        layer_loop="scan" if scan else "unrolled",
        fp8_gemm_backend=gemm,
    )
    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)
    monkeypatch.setattr(jspec.layers.quant, "one_gpu", lambda: True)  # as on one H200
    w = engine.worker
    slot_ids, pt, rows = decode_inputs(w, [0, 1, 2], [[1, 2], [3], [4]], [(jspec.SamplingParams(), 0)] * 3)
    args = (w.params, w.state, slot_ids, pt, rows)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    fn = functools.partial(plain_decode_step, cfg=w.cfg, backend="pallas", sampling="greedy")
    text = lower_for_cuda(fn, *specs).as_text()
    assert "__gpu$xla.gpu.triton" in text
    # Per layer: qkv, o, gate_up and down through the FP8 GEMV kernel (each its own launch).
    assert text.count("skinny_matmul_fp8") >= (4 * w.cfg.num_layers if gemm == "pallas" else 0)
    # The Mosaic GEMV is a jitted function: the layers' calls of one shape share its body.
    assert text.count("custom_call @mosaic_gpu_v2") >= (4 if gemm == "mosaic" else 0)
    signature = text[text.index("func.func public @main") :].split("{", 1)[0]
    assert signature.count("f8E4M3FN") >= 4  # 4 projections (x layers when unrolled)
    assert signature.count("xui8>") >= 2  # the K and V pools: e4m3 bytes

"""Multi-LoRA: a request with an adapter gives the greedy tokens of the base model with that
adapter merged into its weights, in batches that mix adapters, with and without EAGLE-3;
bad adapters are refused by name; adapters load and unload while the engine lives.

The adapters are random PEFT directories written here; the merged oracle is built from
the raw PEFT arrays (W + scale * A^T B^T in jspec's [in, out] layout), independently of
jspec.lora.pool's reading of them.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from support.models import tiny_model

import jspec
from jspec.checkpoint.tiny import make_tiny_model
from jspec.lora.adapter import LoraError
from jspec.worker.inputs import decode_inputs, decode_lora_slots, lora_batch

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "lora", seed=7, max_position_embeddings=512)


def shapes(cfg):
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (H, cfg.q_size),
        "k_proj": (H, cfg.kv_size),
        "v_proj": (H, cfg.kv_size),
        "o_proj": (cfg.q_size, H),
        "gate_proj": (H, I),
        "up_proj": (H, I),
        "down_proj": (I, H),
    }


def write_adapter(path, cfg, rank, targets, seed, alpha=None, rslora=False, config_extra=None, bad_shape=None):
    """A random PEFT adapter dir; returns (path, {(layer, module): (A [r, in], B [out, r])}, scale).
    Large enough to move the tiny model's greedy tokens (asserted by the tests)."""
    rng = np.random.default_rng(seed)
    alpha = alpha if alpha is not None else 2 * rank
    tensors, raw = {}, {}
    for layer in range(cfg.num_layers):
        for m in targets:
            fan_in, fan_out = shapes(cfg)[m]
            if bad_shape == m:
                fan_in += 8
            a = (rng.normal(size=(rank, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
            b = (rng.normal(size=(fan_out, rank)) / np.sqrt(rank) * 0.5).astype(np.float32)
            kind = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{m}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            raw[layer, m] = (a, b)
    os.makedirs(path, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": rslora,
        "task_type": "CAUSAL_LM",
        **(config_extra or {}),
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path), raw, alpha / (np.sqrt(rank) if rslora else rank)


def merged(model, raw, scale):
    """The base model with the adapter folded in: W [in, out] += scale * A^T B^T."""
    cfg = model.cfg
    layers = {k: np.array(v) for k, v in model.params["layers"].items()}
    q, kv, I = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    where = {
        "q_proj": ("wqkv", 0, q),
        "k_proj": ("wqkv", q, q + kv),
        "v_proj": ("wqkv", q + kv, q + 2 * kv),
        "gate_proj": ("w_gate_up", 0, I),
        "up_proj": ("w_gate_up", I, 2 * I),
        "o_proj": ("wo", 0, cfg.hidden_size),
        "down_proj": ("w_down", 0, cfg.hidden_size),
    }
    for (layer, m), (a, b) in raw.items():
        name, lo, hi = where[m]
        layers[name][layer, :, lo:hi] += scale * (a.T @ b.T)
    params = {**model.params, "layers": {k: jax.numpy.asarray(v) for k, v in layers.items()}}
    return dataclasses.replace(model, params=params)


PROMPTS = [
    [1, 5, 9, 33, 70],
    list(range(40, 70)),
    [7] * 3,
    list(range(200, 217)),
    [1, 5, 9, 33, 70, 80, 90],
    list(range(100, 125)),
]
USE = ["a", None, "b", "a", None, "b"]  # one batch mixing both adapters and none
# Every decode pads to 8 rows: one decode program however the rows finish.
ENGINE = dict(
    page_size=4,
    max_total_tokens=1020,
    max_running_requests=8,
    precompile_bs_paddings=[8],
    attention_backend="reference",
)
LORA = dict(max_loras_per_batch=2, max_lora_rank=8)  # one pool shape for every engine here: programs compile once


def greedy(engine, prompts, use, max_new=8):
    ps = [jspec.SamplingParams(max_new_tokens=max_new, ignore_eos=True, lora_path=u) for u in use]
    outs = engine.generate(prompts, ps)
    return [o.token_ids for o in outs], outs


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    # target_modules as PEFT also writes them: a regex over module paths, and "all-linear".
    a = write_adapter(
        d / "a",
        tiny.cfg,
        4,
        ["q_proj", "v_proj", "down_proj"],
        seed=1,
        config_extra={"target_modules": r".*\.(q_proj|v_proj|down_proj)"},
    )
    b = write_adapter(
        d / "b", tiny.cfg, 8, ALL, seed=2, alpha=16, rslora=True, config_extra={"target_modules": "all-linear"}
    )
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def references(tiny, adapters):
    """Per adapter name (None: base), the plain greedy tokens of each prompt."""
    models = {None: tiny, **{n: merged(tiny, raw, s) for n, (_, raw, s) in adapters.items()}}
    refs = {}
    for name, model in models.items():
        refs[name] = greedy(jspec.Engine(model, **ENGINE), PROMPTS, [None] * len(PROMPTS))[0]
    for p in range(len(PROMPTS)):
        # Otherwise the comparison below could not tell an ignored adapter from an applied one.
        assert refs["a"][p] != refs[None][p] and refs["b"][p] != refs[None][p]
    return refs


def expected(refs, use, prompt_ids):
    return [refs[u][p] for u, p in zip(use, prompt_ids)]


def test_mixed_batch_equals_merged_models(tiny, adapters, references):
    engine = jspec.Engine(tiny, lora_paths={n: a[0] for n, a in adapters.items()}, **LORA, **ENGINE)
    got, _ = greedy(engine, PROMPTS, USE)
    assert got == expected(references, USE, range(len(PROMPTS)))
    # The loop unrolled over the stacked weights, with the stacked adapter pool.
    unrolled = jspec.Engine(
        tiny, lora_paths={n: a[0] for n, a in adapters.items()}, layer_loop="unrolled_stack", **LORA, **ENGINE
    )
    assert greedy(unrolled, PROMPTS, USE)[0] == got
    # Again on the same engine with the adapters swapped around: the first round left every
    # prompt's KV in the prefix cache, each under its own adapter (or none), which a request of
    # another adapter must not read.
    use2 = [USE[(i + 1) % len(USE)] for i in range(len(USE))]
    got, _ = greedy(engine, PROMPTS, use2)
    assert got == expected(references, use2, range(len(PROMPTS)))
    # And as the first round: now each request finds its own adapter's KV cached.
    before = engine.scheduler.prefilled_tokens
    got, _ = greedy(engine, PROMPTS, USE)
    assert got == expected(references, USE, range(len(PROMPTS)))
    assert engine.scheduler.prefilled_tokens - before < sum(map(len, PROMPTS)) / 4
    engine.check_idle_no_leaks()


def test_mixed_batch_with_eagle3_is_lossless(tiny, adapters, references):
    from support.models import eagle_draft

    from jspec.speculative.adaptive import Choice, CostTable

    # Adaptive, forced to alternate: every other row verifying its root alone (the ragged verify,
    # whose tokens take their rows' adapters), then off, then every row drafting.
    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, adaptive=True, adaptive_shapes="0,1,1")
    engine = jspec.Engine(
        tiny,
        speculative=spec,
        draft=eagle_draft(tiny, seed=5),
        lora_paths={n: a[0] for n, a in adapters.items()},
        **LORA,
        **ENGINE,
    )
    engine.adaptive.costs = CostTable({}, "unused: the choices are forced")
    step = iter(range(10**6))

    def forced(alphas, bucket, ready=None):
        k = next(step) % 3
        return Choice(1) if k == 1 else Choice(0, [i % 2 == 0 for i in range(len(alphas))] if k == 0 else None)

    engine.adaptive.choose = forced
    got, outs = greedy(engine, PROMPTS, USE)
    assert got == expected(references, USE, range(len(PROMPTS)))
    assert all(o.spec_verify_ct >= 1 for o in outs)
    engine.check_idle_no_leaks()


def test_bad_adapters_are_refused_by_name(tiny, tmp_path):
    engine = jspec.Engine(tiny, **LORA, **ENGINE)
    cfg = tiny.cfg
    too_big = write_adapter(tmp_path / "big", cfg, 16, ["q_proj"], seed=3)[0]
    with pytest.raises(LoraError, match=r"rank r=16 exceeds this engine's max_lora_rank=8"):
        engine.load_lora("big", too_big)
    lm_head = write_adapter(
        tmp_path / "head", cfg, 4, ["q_proj"], seed=3, config_extra={"target_modules": ["q_proj", "lm_head"]}
    )[0]
    with pytest.raises(LoraError, match=r"target modules \['lm_head'\] are not supported"):
        engine.load_lora("head", lm_head)
    shape = write_adapter(tmp_path / "shape", cfg, 4, ["q_proj", "up_proj"], seed=3, bad_shape="up_proj")[0]
    with pytest.raises(LoraError, match=r"up_proj\.lora_A\.weight' has shape \[4, 72\], expected \[4, 64\]"):
        engine.load_lora("shape", shape)
    regex = write_adapter(
        tmp_path / "regex", cfg, 4, ["q_proj", "k_proj"], seed=3, config_extra={"target_modules": r".*\.q_proj"}
    )[0]
    with pytest.raises(LoraError, match=r"k_proj\.lora_A\.weight' is for 'k_proj', which .* does not list"):
        engine.load_lora("regex", regex)
    with pytest.raises(LoraError, match="no adapter_config.json"):
        engine.load_lora("none", str(tmp_path))
    assert engine.lora.slots == {}  # nothing half-loaded
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        engine.add_request([1, 2, 3], jspec.SamplingParams(lora_path="a"))
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        jspec.Engine(tiny, **ENGINE).add_request([1, 2, 3], jspec.SamplingParams(lora_path="a"))


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_mixed_batch_with_eagle3_equals_merged_models(tiny, adapters, references, tp):
    # The tiny model has 2 KV heads: tp 2 splits them, tp 4 repeats each (and so the pool
    # repeats the adapters' k / v columns).
    from support.models import eagle_draft

    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)
    engine = jspec.Engine(
        tiny,
        speculative=spec,
        draft=eagle_draft(tiny, seed=5),
        lora_paths={n: a[0] for n, a in adapters.items()},
        tp_size=tp,
        **LORA,
        **ENGINE,
    )
    got, _ = greedy(engine, PROMPTS, USE)
    assert got == expected(references, USE, range(len(PROMPTS)))
    lw = engine.lora.weights.layers  # stacked as the model's layers: [L, ...]
    # Column-parallel B is split over the shards as its weight is; row-parallel B is whole on each.
    assert lw["b_qkv"].sharding.spec[2] == "tensor" and lw["b_qkv"].addressable_shards[0].data.shape[2] == 1
    assert lw["b_o"].sharding.is_fully_replicated
    wo = engine.worker.params["layers"]["wo"]
    assert wo.sharding.spec[1] == "tensor" and wo.shape[2] > tiny.cfg.hidden_size  # A's columns, split over `in`
    # Rank-4 "a" again, now in the slot rank-8 "b" held: the donated writes keep every array
    # where it was, and nothing of b's higher ranks survives there.
    engine.unload_lora("b")
    assert engine.load_lora("a2", adapters["a"][0]) == engine.lora.slots["a2"] == 2
    assert engine.worker.params["layers"]["wo"].sharding == wo.sharding
    use = ["a2" if u == "b" else u for u in USE]
    got, _ = greedy(engine, PROMPTS, use)
    assert got == expected(references, ["a" if u == "a2" else u for u in use], range(len(PROMPTS)))
    engine.check_idle_no_leaks()


@pytest.mark.parametrize("tp,dp", [(2, 2), (8, 2)])
def test_dp_attention_mixed_batch_with_eagle3_equals_merged_models(tiny, adapters, references, tp, dp):
    # Each rank gets its own requests; the MLP's deltas are computed for every rank's tokens
    # (ranked pool layouts), attention's per rank over tp / dp devices (at 8 / 2, 4 devices
    # for 2 KV heads: each repeated, and so the adapters' k / v columns).
    from support.models import eagle_draft

    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)
    engine = jspec.Engine(
        tiny,
        speculative=spec,
        draft=eagle_draft(tiny, seed=5),
        lora_paths={n: a[0] for n, a in adapters.items()},
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=True,
        **LORA,
        **ENGINE,
    )
    got, _ = greedy(engine, PROMPTS, USE)
    assert got == expected(references, USE, range(len(PROMPTS)))
    assert engine.lora.weights.layers["b_gate_up"].sharding.spec[2:4] == ("data", "tensor")  # [L, N, dp, tp, n]
    engine.check_idle_no_leaks()


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_model_attention_adapter_equals_merged_model(tmp_path, tp):
    # On an MoE model (Qwen3-MoE, every layer's MLP is experts) adapters apply to the attention
    # projections; one on an experts layer's MLP is refused by name. tp 2 splits the experts
    # over the devices (EP) while attention stays tensor-parallel.
    moe = jspec.load(
        make_tiny_model(
            str(tmp_path / "moe"),
            arch="qwen3_moe",
            seed=12,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=512,
        ),
        dtype="float32",
    )
    path, raw, scale = write_adapter(tmp_path / "attn", moe.cfg, 4, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=4)
    ref = greedy(jspec.Engine(merged(moe, raw, scale), **ENGINE), PROMPTS[:3], [None] * 3)[0]
    base = greedy(jspec.Engine(moe, **ENGINE), PROMPTS[:3], [None] * 3)[0]
    assert all(r != b for r, b in zip(ref, base))
    engine = jspec.Engine(moe, lora_paths={"attn": path}, tp_size=tp, ep_size=tp, **LORA, **ENGINE)
    assert greedy(engine, PROMPTS[:3], ["attn", None, "attn"])[0] == [ref[0], base[1], ref[2]]
    mlp = write_adapter(tmp_path / "mlp", moe.cfg, 4, ["q_proj", "gate_proj"], seed=5)[0]
    with pytest.raises(LoraError, match=r"layers\.0\.mlp\.gate_proj.* the MLP of layer 0, a mixture-of-experts layer"):
        engine.load_lora("mlp", mlp)
    assert set(engine.lora.slots) == {"attn"}
    engine.check_idle_no_leaks()


def test_load_use_unload_reload_without_restart(tiny, adapters, references):
    # Batches of the shapes above, so the programs compiled there serve here too.
    import re

    engine = jspec.Engine(tiny, **LORA, **ENGINE)
    (pa, _, _), (pb, _, _) = adapters["a"], adapters["b"]
    engine.load_lora("a", pa)
    use = ["a", None, "a", None, "a", None]
    assert greedy(engine, PROMPTS, use)[0] == expected(references, use, range(len(PROMPTS)))

    rids = [
        engine.add_request(p, jspec.SamplingParams(max_new_tokens=8, ignore_eos=True, lora_path=u))
        for p, u in zip(PROMPTS, use)
    ]
    engine.step()
    users = sorted(r for r, u in zip(rids, use) if u == "a")
    with pytest.raises(ValueError, match=rf"'a' is in use by running requests {re.escape(str(users))}"):
        engine.unload_lora("a")
    while engine.has_work():
        engine.step()
    engine.unload_lora("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        engine.add_request(PROMPTS[0], jspec.SamplingParams(lora_path="a"))

    # b takes the freed slot (the lowest free one); then a comes back beside it.
    engine.load_lora("b", pb)
    assert engine.lora.slots == {"b": 1}
    engine.load_lora("a", pa)
    use = ["b", "a", "b", "a", None, "b"]
    assert greedy(engine, PROMPTS, use)[0] == expected(references, use, range(len(PROMPTS)))
    engine.check_idle_no_leaks()


def test_server_flags_and_routes(tiny, adapters, references, tmp_path, monkeypatch):
    """The server's LoRA flags build the engine; the HTTP API picks adapters by lora_path or
    model "base:adapter" and loads / unloads them while it runs (in-process: the programs
    compiled above are reused). Adapters named by Hub repo ids load from huggingface_hub's
    cache (offline), at start-up and by /load_lora_adapter."""
    from fastapi.testclient import TestClient
    from support.hub import add_snapshot, use_cache

    from jspec.engine.async_engine import AsyncEngine
    from jspec.server.app import create_app
    from jspec.server.args import build_parser, engine_config

    (pa, _, _), (pb, _, _) = adapters["a"], adapters["b"]
    add_snapshot(str(tmp_path / "hub"), "org/lora-a", pa)
    use_cache(monkeypatch, str(tmp_path / "hub"))
    config = engine_config(
        build_parser().parse_args(
            ["--lora-paths", "a=org/lora-a", pb, "--max-loras-per-batch", "2", "--max-lora-rank", "8"]
        )
    )
    assert config.lora_paths == {"a": "org/lora-a", "b": pb}  # b named by its directory
    assert (config.max_loras_per_batch, config.max_lora_rank, config.serves_lora) == (2, 8, True)
    assert not engine_config(build_parser().parse_args([])).serves_lora
    aengine = AsyncEngine(jspec.Engine(tiny, config, **ENGINE))
    try:
        with TestClient(create_app(aengine, "tiny")) as c:

            def gen(p, lora=None):
                r = c.post(
                    "/generate",
                    json={
                        "input_ids": PROMPTS[p],
                        "lora_path": lora,
                        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
                    },
                )
                return r.status_code, r.json()

            code, body = gen(0, "a")
            assert code == 200 and body["output_ids"] == references["a"][0]
            assert gen(1)[1]["output_ids"] == references[None][1]
            r = c.post(
                "/v1/completions",
                json={"model": "tiny:b", "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == gen(2, "b")[1]["text"]
            assert gen(2, "b")[1]["output_ids"] == references["b"][2]
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "tiny:a", "tiny:b"]
            r = c.post("/v1/completions", json={"model": "tiny:zzz", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 400 and "unknown LoRA adapter 'zzz'" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"model": "tiny:a", "lora_path": "b", "prompt": "hi"})
            assert r.status_code == 400 and "lora_path names 'b'" in r.json()["error"]["message"]
            assert c.post("/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404

            r = c.post("/unload_lora_adapter", json={"lora_name": "a"})
            assert r.status_code == 200 and r.json()["loaded_adapters"] == {"b": pb}
            assert gen(0, "a")[0] == 400
            r = c.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": "/nonexistent"})
            assert r.status_code == 400 and "no adapter_config.json" in r.json()["error"]["message"]
            r = c.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": "org/no-such-adapter"})
            assert r.status_code == 400 and "adapter 'org/no-such-adapter'" in r.json()["error"]["message"]
            r = c.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": "org/lora-a"})
            assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a2", "b"}
            assert gen(0, "a2")[1]["output_ids"] == references["a"][0]
    finally:
        aengine.shutdown()


def test_lora_decode_step_lowers_for_cuda(tmp_path):
    """The step with the adapter pool lowers for an H200 in bfloat16 (docs/architecture.md's jit-compile
    check: interpret-mode CPU runs hide GPU lowering errors)."""
    import functools

    from support.lowering import lower_for_cuda

    from jspec.steps.plain import plain_decode_step

    path = make_tiny_model(str(tmp_path / "bf16"), seed=7, max_position_embeddings=512, dtype="bfloat16")
    engine = jspec.Engine(jspec.load(path, dtype=jax.numpy.bfloat16), page_size=16, max_total_tokens=1008, **LORA)
    w = engine.worker
    slot_ids, pt, rows = decode_inputs(w, [0, 1, 2], [[1, 2], [3], [4]], [(jspec.SamplingParams(), 0)] * 3)
    args = (w.params, w.state, slot_ids, pt, rows, lora_batch(w.lora, decode_lora_slots(slot_ids.shape[0], [1, 0, 2])))
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    lowered = lower_for_cuda(
        functools.partial(plain_decode_step, cfg=w.cfg, backend="pallas", sampling="greedy"), *specs
    )
    text = lowered.as_text()
    # In the scanned layer body (compiled once), 4 fused projections (their weights carrying
    # the pool's A columns) and 4 LoRA B matmuls; then the logits.
    assert "bf16" in text and "stablehlo.while" in text and text.count("dot_general") >= 8 + 1

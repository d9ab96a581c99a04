"""NEXTN on a standard-attention family: a tiny MiMo checkpoint (Qwen2 with an MTP layer at
model.mtp_layers.0, in MiMo's published names) drafts with its MTP layer; greedy output equals
plain greedy (chain and tree, page sizes 16 and 1, overlap on and off)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.checkpoint.files import read_hf_tensors, write_safetensors
from jspec.checkpoint.tiny import make_tiny_model
from jspec.config.load import LoadConfig
from jspec.config.spec import SpecConfig

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

# Loaded from its path, float32 on every backend (the loader's default is bfloat16 on a GPU).
FLOAT32 = LoadConfig(dtype="float32")

PROMPTS = [[5, 9, 13, 200, 7], list(range(11, 31)), [5, 9, 13, 200, 7, 31]]


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("mimo") / "m"), "qwen2", seed=4, max_position_embeddings=512)
    tensors = {k: np.asarray(v) for k, v in read_hf_tensors(path).items()}
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    H, I = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * (H // config["num_attention_heads"])
    kv = config["num_key_value_heads"] * (H // config["num_attention_heads"])
    rng = np.random.default_rng(8)

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    p = "model.mtp_layers.0."
    tensors.update(
        {
            p + "token_layernorm.weight": norm(),
            p + "hidden_layernorm.weight": norm(),
            p + "input_proj.weight": w(H, 2 * H),
            p + "input_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(q, H),
            p + "self_attn.q_proj.bias": 0.1 * w(q),
            p + "self_attn.k_proj.weight": w(kv, H),
            p + "self_attn.k_proj.bias": 0.1 * w(kv),
            p + "self_attn.v_proj.weight": w(kv, H),
            p + "self_attn.v_proj.bias": 0.1 * w(kv),
            p + "self_attn.o_proj.weight": w(H, q),
            p + "post_attention_layernorm.weight": norm(),
            p + "mlp.gate_proj.weight": w(I, H),
            p + "mlp.up_proj.weight": w(I, H),
            p + "mlp.down_proj.weight": w(H, I),
            p + "final_layernorm.weight": norm(),
        }
    )
    write_safetensors(path, tensors)
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    model = jspec.load(path, dtype=jnp.float32)
    assert model.cfg.family == "qwen2" and model.cfg.num_mtp_layers == 1
    return path, model


def engine_kw(page_size, overlap):
    return dict(
        page_size=page_size,
        max_total_tokens=127 * page_size,
        max_running_requests=4,
        precompile_bs_paddings=[4],  # one decode program however the rows finish
        attention_backend="reference",
        disable_overlap_schedule=not overlap,
    )


@pytest.fixture(scope="module")
def plain_greedy(mimo):
    _, model = mimo
    engine = jspec.Engine(model, **engine_kw(16, True))
    return [o.token_ids for o in jspec.generate(model, PROMPTS, max_new_tokens=8, ignore_eos=True, engine=engine)]


@pytest.mark.parametrize("page_size,overlap,steps,topk,ndt", [(16, True, 3, 1, None), (1, False, 2, 3, 5)])
def test_mimo_nextn_greedy_equals_plain_greedy(mimo, plain_greedy, page_size, overlap, steps, topk, ndt):
    path, _ = mimo
    spec = SpecConfig("NEXTN", num_steps=steps, eagle_topk=topk, num_draft_tokens=ndt)
    engine = jspec.Engine(path, load=FLOAT32, speculative=spec, **engine_kw(page_size, overlap))
    out = jspec.generate(engine.model, PROMPTS, max_new_tokens=8, ignore_eos=True, engine=engine)
    engine.check_idle_no_leaks()
    assert [o.token_ids for o in out] == plain_greedy


def test_mimo_nextn_accepts_a_perfect_mtp_layer(mimo, tmp_path):
    """Attention outputs and MLPs zeroed, lm_head row perm[x] = embed[x]: the target continues x
    with perm[x], and so does the MTP layer, whose input_proj passes on only the embedding half
    of MiMo's [hidden | embedding] input. Every draft is accepted only if that order is read
    right."""
    src, _ = mimo
    tensors = {k: np.array(v) for k, v in read_hf_tensors(src).items()}
    V, H = tensors["model.embed_tokens.weight"].shape
    perm = np.random.default_rng(3).permutation(V)
    tensors["lm_head.weight"][perm] = tensors["model.embed_tokens.weight"]
    tensors["model.norm.weight"][:] = 1
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name][:] = 0
    p = "model.mtp_layers.0."
    tensors[p + "input_proj.weight"] = np.concatenate([np.zeros((H, H)), np.eye(H)], axis=1).astype(np.float32)
    tensors[p + "token_layernorm.weight"][:] = 1
    tensors[p + "final_layernorm.weight"][:] = 1
    path = str(tmp_path / "copying")
    os.makedirs(path)
    write_safetensors(path, tensors)
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(path, "config.json"), "w") as g:
        g.write(f.read())
    steps = 3
    engine = jspec.Engine(path, load=FLOAT32, speculative=SpecConfig("NEXTN", num_steps=steps), **engine_kw(16, True))
    out = jspec.generate(engine.model, PROMPTS, max_new_tokens=4 * (steps + 1), ignore_eos=True, engine=engine)
    for prompt, o in zip(PROMPTS, out):
        want, t = [], prompt[-1]
        for _ in o.token_ids:
            t = int(perm[t])
            want.append(t)
        assert o.token_ids == want
        assert o.mean_accept_length == steps + 1

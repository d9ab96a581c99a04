"""Checkpoint loader, tiny-model writer, tokenizer, and agreement with HF transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from support import REPO_ROOT
from support.hf_reference import HF_VARIANTS, hf_inspect, hf_make_checkpoints, hf_python, requires_hf

from jspec.checkpoint.errors import (
    CorruptCheckpointError,
    MissingTensorError,
    NoSafetensorsError,
    TensorShapeError,
)
from jspec.checkpoint.files import read_hf_tensors
from jspec.checkpoint.loader import (
    convert_checkpoint,
    count_params,
    init_random_params,
    load_model,
    param_shapes,
    restore_params,
    save_params,
)
from jspec.checkpoint.tiny import EOS_IDS, make_tiny_model
from jspec.checkpoint.tokenizer import load_tokenizer
from jspec.config.errors import UnsupportedArchitectureError
from jspec.config.model import RopeScaling

REPO = REPO_ROOT
ARCH_CASES = [
    ("llama", False),
    ("llama", True),
    ("mistral", False),
    ("qwen2", False),
    ("qwen2", True),
    ("qwen3", False),
    ("qwen3", True),
]


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def assert_matches_hf(cfg, params, hf: dict[str, np.ndarray]) -> None:
    """Every leaf equals the HF tensors it came from (written as slices, not as the loader builds them)."""
    q, kv = cfg.q_size, cfg.kv_size
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_array_equal(_np(params["embed"]), f32(hf["model.embed_tokens.weight"]))
    np.testing.assert_array_equal(_np(params["final_norm"]), f32(hf["model.norm.weight"]))
    if cfg.tie_word_embeddings:
        assert "lm_head" not in params
    else:
        np.testing.assert_array_equal(_np(params["lm_head"]), f32(hf["lm_head.weight"]).T)
    lay = {k: _np(v) for k, v in params["layers"].items()}
    for i in range(cfg.num_layers):
        h = lambda n: f32(hf[f"model.layers.{i}.{n}"])  # noqa: E731
        np.testing.assert_array_equal(lay["attn_norm"][i], h("input_layernorm.weight"))
        np.testing.assert_array_equal(lay["mlp_norm"][i], h("post_attention_layernorm.weight"))
        np.testing.assert_array_equal(lay["wqkv"][i][:, :q], h("self_attn.q_proj.weight").T)
        np.testing.assert_array_equal(lay["wqkv"][i][:, q : q + kv], h("self_attn.k_proj.weight").T)
        np.testing.assert_array_equal(lay["wqkv"][i][:, q + kv :], h("self_attn.v_proj.weight").T)
        np.testing.assert_array_equal(lay["wo"][i], h("self_attn.o_proj.weight").T)
        I = cfg.intermediate_size
        np.testing.assert_array_equal(lay["w_gate_up"][i][:, :I], h("mlp.gate_proj.weight").T)
        np.testing.assert_array_equal(lay["w_gate_up"][i][:, I:], h("mlp.up_proj.weight").T)
        np.testing.assert_array_equal(lay["w_down"][i], h("mlp.down_proj.weight").T)
        if cfg.qkv_bias:
            np.testing.assert_array_equal(
                lay["bqkv"][i],
                np.concatenate([h("self_attn.q_proj.bias"), h("self_attn.k_proj.bias"), h("self_attn.v_proj.bias")]),
            )
        else:
            assert "bqkv" not in lay
        if cfg.qk_norm:
            np.testing.assert_array_equal(lay["q_norm"][i], h("self_attn.q_norm.weight"))
            np.testing.assert_array_equal(lay["k_norm"][i], h("self_attn.k_norm.weight"))
        else:
            assert "q_norm" not in lay and "k_norm" not in lay
        if cfg.o_bias:
            np.testing.assert_array_equal(lay["bo"][i], h("self_attn.o_proj.bias"))
        else:
            assert "bo" not in lay


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        (arch, tied): make_tiny_model(
            root / f"{arch}-{'tied' if tied else 'untied'}", arch, seed=1, tie_word_embeddings=tied
        )
        for arch, tied in ARCH_CASES
    }


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("bf16") / "m", "llama", seed=2, dtype="bfloat16", rope_scaling="llama3"
    )


def _copy(src, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", ARCH_CASES)
def test_round_trip_each_arch(tiny_dirs, arch, tied):
    path = tiny_dirs[(arch, tied)]
    cfg, params = load_model(path, dtype=jnp.float32)
    assert cfg.family == arch and cfg.tie_word_embeddings == tied
    assert cfg.qkv_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    if arch == "qwen3":
        assert cfg.head_dim * cfg.num_heads != cfg.hidden_size  # exercises q_size != hidden
    assert jax.tree.map(lambda x: tuple(x.shape), params) == param_shapes(cfg)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    hf = read_hf_tensors(path)
    assert count_params(params) == sum(a.size for a in hf.values())
    assert_matches_hf(cfg, params, hf)


def test_sharded_index_equals_single_file(tmp_path):
    single = make_tiny_model(tmp_path / "single", "qwen2", seed=5)
    sharded = make_tiny_model(tmp_path / "sharded", "qwen2", seed=5, num_shards=2)
    files = sorted(os.listdir(sharded))
    assert "model.safetensors" not in files
    assert {
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    } <= set(files)
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) == 2
    _, p1 = load_model(single, dtype=jnp.float32)
    cfg, p2 = load_model(sharded, dtype=jnp.float32)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(_np(a), _np(b)), p1, p2)
    assert_matches_hf(cfg, p2, read_hf_tensors(sharded))


def test_bf16_checkpoint(llama_bf16):
    raw = read_hf_tensors(llama_bf16)
    assert all(a.dtype == ml_dtypes.bfloat16 for a in raw.values())
    cfg, p16 = load_model(llama_bf16, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    np.testing.assert_array_equal(
        _np(p16["layers"]["wqkv"][1][:, : cfg.q_size]), raw["model.layers.1.self_attn.q_proj.weight"].T
    )
    _, p32 = load_model(llama_bf16, dtype=jnp.float32)  # exact widening of bf16
    assert p32["embed"].dtype == jnp.float32
    assert_matches_hf(cfg, p32, raw)
    _, default = load_model(llama_bf16)
    assert default["embed"].dtype == (jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


def test_orbax_round_trip_exact(llama_bf16, tmp_path):
    cfg, params = load_model(llama_bf16, dtype="bfloat16")
    out = save_params(params, tmp_path / "ckpt", config=cfg)
    restored = restore_params(out)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored)):
        assert b.dtype == jnp.bfloat16 and a.shape == b.shape
        np.testing.assert_array_equal(_np(a).view(np.uint16), _np(b).view(np.uint16))  # bit-exact

    cfg2, params2 = load_model(out, dtype=jnp.float32)  # detected as a converted directory; cast on restore
    assert cfg2 == cfg and isinstance(cfg2.rope_scaling, RopeScaling) and cfg2.eos_token_ids == tuple(EOS_IDS)
    assert params2["embed"].dtype == jnp.float32
    np.testing.assert_array_equal(_np(params2["layers"]["w_down"]), _np(params["layers"]["w_down"]).astype(np.float32))

    converted = convert_checkpoint(llama_bf16, tmp_path / "converted", dtype=jnp.bfloat16)
    cfg3, params3 = load_model(converted, dtype=jnp.bfloat16)
    assert cfg3 == cfg
    np.testing.assert_array_equal(_np(params3["lm_head"]).view(np.uint16), _np(params["lm_head"]).view(np.uint16))
    assert load_tokenizer(converted).encode("hi") == [256, 104, 105]


def assert_per_layer_matches_stacked(cfg, per_layer, stacked) -> None:
    """per_layer holds the same arrays as stacked, with the layers as a list of per-layer
    dicts and no leaf over all layers."""
    assert isinstance(per_layer["layers"], list) and len(per_layer["layers"]) == cfg.num_layers
    for i, lp in enumerate(per_layer["layers"]):
        for name, leaf in lp.items():
            expected = stacked["layers"][i][name] if isinstance(stacked["layers"], list) else stacked["layers"][name][i]
            for got, want in zip(jax.tree.leaves(leaf), jax.tree.leaves(expected)):  # an Fp8Weight: weight, scale
                assert got.dtype == want.dtype, name
                np.testing.assert_array_equal(_np(got), _np(want), err_msg=f"layer {i} {name}")
    for name in ("embed", "final_norm", "lm_head"):
        if name in stacked:
            np.testing.assert_array_equal(_np(per_layer[name]), _np(stacked[name]))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True), ("qwen3", False), ("mixtral", False)])
def test_per_layer_load_builds_the_stacked_loads_arrays(tiny_dirs, tmp_path, arch, tied):
    """load_model(per_layer=True), the layout one GPU runs: each layer's arrays built as they
    are, equal to the stacked load's rows (dense, biased, qk-normed, MoE)."""
    path = tiny_dirs[(arch, tied)] if (arch, tied) in tiny_dirs else make_tiny_model(tmp_path / arch, arch, seed=3)
    cfg, stacked = load_model(path, dtype=jnp.float32)
    cfg_pl, per_layer = load_model(path, dtype=jnp.float32, per_layer=True)
    assert cfg_pl == cfg
    assert jax.tree.map(lambda x: tuple(x.shape), per_layer) == param_shapes(cfg, per_layer=True)
    assert_per_layer_matches_stacked(cfg, per_layer, stacked)


def test_per_layer_load_of_a_converted_directory(llama_bf16, tmp_path):
    """A jspec converted directory loaded per layer: restored on the host, each layer's arrays
    on the default device alone, equal to the stacked restore's rows."""
    cfg, params = load_model(llama_bf16, dtype=jnp.bfloat16)
    out = save_params(params, tmp_path / "ckpt", config=cfg)
    _, stacked = load_model(out, dtype=jnp.bfloat16)
    _, per_layer = load_model(out, dtype=jnp.bfloat16, per_layer=True)
    assert jax.tree.map(lambda x: tuple(x.shape), per_layer) == param_shapes(cfg, per_layer=True)
    assert_per_layer_matches_stacked(cfg, per_layer, stacked)
    assert {d for x in jax.tree.leaves(per_layer) for d in x.devices()} == {jax.devices()[0]}


def test_per_layer_load_of_an_fp8_checkpoint(tmp_path):
    from jspec.testing.fp8 import write_fp8_checkpoint

    src = make_tiny_model(tmp_path / "src", seed=1, tokenizer=False)
    path = write_fp8_checkpoint(src, tmp_path / "fp8", "ct_channel_dynamic")
    cfg, stacked = load_model(path, dtype=jnp.float32)
    _, per_layer = load_model(path, dtype=jnp.float32, per_layer=True)
    assert_per_layer_matches_stacked(cfg, per_layer, stacked)


def test_per_layer_random_params(tiny_dirs):
    cfg, _ = load_model(tiny_dirs[("llama", False)], dtype=jnp.float32)
    params = init_random_params(cfg, jax.random.key(0), jnp.bfloat16, per_layer=True)
    assert jax.tree.map(lambda x: tuple(x.shape), params) == param_shapes(cfg, per_layer=True)
    assert not np.array_equal(_np(params["layers"][0]["wqkv"]), _np(params["layers"][1]["wqkv"]))
    norm = _np(params["layers"][1]["attn_norm"]).astype(np.float32)
    assert 0.9 < norm.mean() < 1.1


def test_a_large_models_random_weights_compile_one_draw_per_shape(tiny_dirs, monkeypatch):
    """Past the flat-draw limit each tensor is drawn by a program of its shape alone, so a
    model's layers share their compiled draws; the values are each tensor's own key's draw."""
    from jspec.checkpoint import random_weights as rw

    cfg, _ = load_model(tiny_dirs[("llama", False)], dtype=jnp.float32)
    monkeypatch.setattr(rw, "_FLAT_DRAW_LIMIT", 0)
    rw._draw_one.clear_cache()
    shapes = param_shapes(cfg, per_layer=True)
    params = rw.random_weights(shapes, jax.random.key(3), jnp.float32, std=0.02)
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    distinct = {(shape, "norm" in jax.tree_util.keystr(path)) for path, shape in flat}
    assert rw._draw_one._cache_size() == len(distinct) < len(flat)
    keys = jax.random.split(jax.random.key(3), len(flat))
    for (path, shape), key, got in zip(flat, keys, jax.tree.leaves(params)):
        noise = np.asarray(jax.random.normal(key, (int(np.prod(shape)),), jnp.float32)).reshape(shape)
        want = 1.0 + 0.1 * noise if "norm" in jax.tree_util.keystr(path) else 0.02 * noise
        np.testing.assert_allclose(_np(got), want, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_init_random_params(tiny_dirs):
    cfg, loaded = load_model(tiny_dirs[("qwen2", False)], dtype=jnp.float32)
    params = init_random_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert jax.tree.structure(params) == jax.tree.structure(loaded)
    assert jax.tree.map(lambda x: tuple(x.shape), params) == param_shapes(cfg)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    w = _np(params["layers"]["w_gate_up"]).astype(np.float32)
    assert 0.018 < w.std() < 0.022 and abs(w.mean()) < 0.002
    norm = _np(params["layers"]["attn_norm"]).astype(np.float32)
    assert 0.95 < norm.mean() < 1.05 and norm.std() > 0.05
    again = init_random_params(cfg, jax.random.key(0), jnp.bfloat16)
    np.testing.assert_array_equal(_np(params["embed"]), _np(again["embed"]))
    assert not np.array_equal(_np(params["layers"]["wqkv"][0]), _np(params["layers"]["wqkv"][1]))


def test_make_tiny_model_cli(tmp_path):
    out = tmp_path / "cli"
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "scripts", "make_tiny_model.py"),
            str(out),
            "--arch",
            "qwen3",
            "--layers",
            "3",
            "--hidden",
            "32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--dtype",
            "bfloat16",
            "--shards",
            "2",
            "--tie-embeddings",
        ],
        check=True,
        capture_output=True,
    )
    cfg, params = load_model(out)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "qwen3",
        3,
        32,
        2,
        1,
        32,
    )
    assert cfg.tie_word_embeddings and "lm_head" not in params
    assert os.path.isfile(out / "model.safetensors.index.json")


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["Hello, world!", "héllo wörld — 你好, мир 🙂\n\ttabs  and  spaces", ""])
def test_tokenizer_round_trip(tiny_dirs, text):
    tok = load_tokenizer(tiny_dirs[("llama", False)])
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    assert ids[1:] == list(text.encode("utf-8"))  # byte-level: id == byte
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_tokenizer_special_ids_and_template(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    tok = load_tokenizer(path)
    assert tok.eos_token_ids == (257, 258)
    assert tok.decode([72, 105, 258, 33]) == "Hi!"
    assert "<|start_header_id|>" in tok.chat_template and "messages" in tok.chat_template
    # Ids gathered from every file that has them; dict-form tokens as transformers writes them.
    with open(path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": 259}, f)
    with open(path / "tokenizer_config.json") as f:
        tc = json.load(f)
    tc["eos_token"] = {"content": "<|end_header_id|>", "special": True}
    tc["bos_token"] = None
    with open(path / "tokenizer_config.json", "w") as f:
        json.dump(tc, f)
    tok = load_tokenizer(path)
    assert tok.eos_token_ids == (259, 257, 258, 260)  # generation_config, config.json, tokenizer_config
    assert tok.bos_token_id == 256  # falls back to config.json's bos_token_id
    os.remove(path / "tokenizer.json")
    assert load_tokenizer(path) is None


# ---------------------------------------------------------------------------
# Errors say what is wrong and where
# ---------------------------------------------------------------------------


def _rewrite_tensors(path, edit):
    tensors = {k: np.array(v) for k, v in read_hf_tensors(path).items()}
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def test_error_unknown_architecture(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    with open(path / "config.json") as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(path)
    assert "GPT2LMHeadModel" in str(e.value) and str(path) in str(e.value) and "LlamaForCausalLM" in str(e.value)


def test_error_missing_tensor(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs[("qwen2", False)], tmp_path)
    _rewrite_tensors(
        path, lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("model.layers.0.self_attn.k_proj.bias"))
    )
    with pytest.raises(MissingTensorError) as e:
        load_model(path)
    msg = str(e.value)
    assert isinstance(e.value, KeyError)
    assert "'model.layers.1.mlp.up_proj.weight'" in msg and "'model.layers.0.self_attn.k_proj.bias'" in msg
    assert "missing 2 tensor(s)" in msg and str(path) in msg


def test_error_missing_lm_head_when_untied(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    _rewrite_tensors(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(MissingTensorError, match="'lm_head.weight'"):
        load_model(path)


def test_error_wrong_shape(tiny_dirs, tmp_path):
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    _rewrite_tensors(
        path, lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight", np.zeros((64, 64), np.float32))
    )
    with pytest.raises(TensorShapeError) as e:
        load_model(path)
    msg = str(e.value)
    assert "'model.layers.1.self_attn.k_proj.weight': expected [32, 64], got [64, 64]" in msg and str(path) in msg


def test_error_missing_directory_and_files(tiny_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        load_model(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)

    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    os.remove(path / "config.json")
    with pytest.raises(FileNotFoundError, match="no config.json") as e:
        load_model(path)
    assert str(path) in str(e.value)

    path = _copy(tiny_dirs[("llama", False)], tmp_path, "noweights")
    os.remove(path / "model.safetensors")
    with pytest.raises(NoSafetensorsError, match="no model.safetensors") as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_error_missing_shard_and_truncated_file(tmp_path):
    path = make_tiny_model(tmp_path / "sharded", "llama", num_shards=2)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(NoSafetensorsError, match="model-00002-of-00002.safetensors"):
        load_model(path)

    path = make_tiny_model(tmp_path / "trunc", "llama")
    f = os.path.join(path, "model.safetensors")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_model(path)


# ---------------------------------------------------------------------------
# Agreement with transformers (needs the HF venv)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    if hf_python() is None:
        pytest.skip("no HF python")
    return hf_make_checkpoints(tmp_path_factory.mktemp("hf"), LLAMA_LAYOUT_VARIANTS, dump_params=True)


# The variants of Llama's tensor layout, which assert_matches_hf knows (the other families'
# layouts are checked through their logits: tests/parity/test_hf_parity.py).
LLAMA_LAYOUT_VARIANTS = {
    name: HF_VARIANTS[name]
    for name in (
        "llama",
        "llama3_rope",
        "llama_tied",
        "llama_attention_bias",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_tied",
    )
}


@requires_hf
@pytest.mark.parametrize("variant", list(LLAMA_LAYOUT_VARIANTS))
def test_hf_written_checkpoints_load(hf_checkpoints, variant):
    ref = hf_checkpoints[variant]
    cfg, params = load_model(ref["path"], dtype=jnp.float32)
    arch, overrides = HF_VARIANTS[variant]
    assert cfg.family == arch
    assert cfg.tie_word_embeddings == overrides.get("tie_word_embeddings", False)
    assert (cfg.rope_scaling is not None) == ("rope_scaling" in overrides)
    assert count_params(params) == ref["num_params"]
    assert_matches_hf(cfg, params, ref["params"])


@requires_hf
def test_hf_loads_our_tiny_checkpoints(tiny_dirs, llama_bf16):
    ours = {
        f"{a}-{t}": tiny_dirs[(a, t)]
        for a, t in [("llama", True), ("mistral", False), ("qwen2", True), ("qwen3", False)]
    }
    ours["llama-bf16"] = llama_bf16
    refs = hf_inspect(ours)  # fails if transformers finds a missing/unexpected/mis-shaped weight
    for name, path in ours.items():
        cfg, params = load_model(path, dtype=jnp.float32)
        assert count_params(params) == refs[name]["num_params"], name
        assert_matches_hf(cfg, params, refs[name]["params"])


def test_loading_many_shards_reports_progress_then_the_time_taken(tmp_path, caplog, monkeypatch):
    """Log lines (every tenth of the bytes: shards read, bytes, seconds) when stderr is no
    terminal; a bar with the shards beside the bytes when it is one. One shard: no report."""
    import io
    import logging

    import jspec

    path = make_tiny_model(str(tmp_path / "m"), seed=3, num_layers=4, num_shards=4)
    with caplog.at_level(logging.INFO, logger="jspec.checkpoint"):
        model = jspec.load(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "jspec.checkpoint"]
    steps = [line for line in lines if line.startswith("loading m: ")]
    assert 5 <= len(steps) <= 9 and all(" of 4 shards read, " in line and "MiB of 0.7 MiB" in line for line in steps)
    assert lines[-1].startswith("read m: 4 shards, 0.7 MiB, in ") and lines[-1].endswith(" s")
    assert model.params["embed"].shape[0] == 320

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    caplog.clear()
    monkeypatch.setattr(sys, "stderr", Terminal())
    jspec.load(path)
    bar = sys.stderr.getvalue()
    assert "loading m: 100%" in bar and "4/4 shards" in bar
    assert not [r for r in caplog.records if r.name == "jspec.checkpoint"]
    jspec.load(make_tiny_model(str(tmp_path / "one"), seed=3))
    assert sys.stderr.getvalue() == bar  # one shard: nothing to follow

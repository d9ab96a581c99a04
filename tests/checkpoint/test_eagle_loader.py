"""EAGLE / EAGLE-3 draft-head loading: both published layouts, safetensors and
pytorch_model.bin (written by real torch.save in the HF venv, read without
torch), values and transposes, and the errors a wrong checkpoint gets."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import zipfile
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from support.hf_reference import NO_HF_REASON, hf_python

from jspec.checkpoint.eagle import (
    DraftAlgorithmMismatchError,
    MissingTensorError,
    TensorShapeError,
    UnknownDraftLayoutError,
    draft_param_shapes,
    init_random_draft_params,
    load_draft_model,
)
from jspec.checkpoint.files import write_safetensors
from jspec.checkpoint.torch_pickle import UnsafePickleError, read_torch_bin_file
from jspec.config.draft import DraftConfig
from jspec.config.model import ModelConfig
from jspec.testing import eagle_tiny

TARGET = ModelConfig(
    family="llama",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=500000.0,
)
# A deeper target, so SGLang's default capture layers [2, L//2, L-3] are distinct.
DEEP_TARGET = ModelConfig(
    family="llama",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)

# Runs in the HF venv: torch.save each job's npz as a state dict. With
# "views", weights are saved as non-contiguous views (a transpose of their
# transpose, vectors as a slice at an offset into a larger storage), so the
# reader's strides and storage offsets are exercised on real torch output.
TORCH_SAVE = r"""
import collections, json, sys
import numpy as np, torch
for job in json.load(open(sys.argv[1])):
    dtype = getattr(torch, job["dtype"])
    sd = collections.OrderedDict()
    with np.load(job["npz"]) as data:
        for name in data.files:
            t = torch.from_numpy(data[name].copy())
            if t.is_floating_point():
                t = t.to(dtype)
                if job["views"] and t.dim() == 2:
                    t = t.t().contiguous().t()
                elif job["views"] and t.dim() == 1:
                    t = torch.cat([torch.zeros(3, dtype=dtype), t, torch.zeros(2, dtype=dtype)])[3:3 + t.numel()]
            sd[name] = t
    torch.save(sd, job["out"])
"""


def torch_save_many(tmp_path: Path, jobs: list[tuple[dict[str, np.ndarray], Path, str, bool]]) -> None:
    """One HF-venv subprocess (one torch start-up) for several torch.save calls."""
    py = hf_python()
    if py is None:
        pytest.skip(NO_HF_REASON)
    spec = []
    for k, (tensors, out, dtype, views) in enumerate(jobs):
        npz = tmp_path / f"in{k}.npz"
        np.savez(
            npz, **{n: np.asarray(a, np.float32) if a.dtype == ml_dtypes.bfloat16 else a for n, a in tensors.items()}
        )
        spec.append({"npz": str(npz), "out": str(out), "dtype": dtype, "views": views})
    req = tmp_path / "torch_save.json"
    req.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([py, "-c", TORCH_SAVE, str(req)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def hf_of(alg: str, target: ModelConfig = TARGET, **kw) -> dict:
    return eagle_tiny.draft_hf_config(target, alg, **kw)


def write_dir(d: Path, hf: dict, tensors: dict[str, np.ndarray]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    write_safetensors(str(d), tensors)
    eagle_tiny.write_draft_config(d, hf)
    return d


def check_values(cfg: DraftConfig, params: dict, t: dict[str, np.ndarray], dtype=np.float32) -> None:
    """Every leaf equals the HF tensor it came from: [out, in] -> [in, out], q|k|v and gate|up
    concatenated on the out axis, layers stacked on axis 0."""

    def f(name):
        return np.asarray(t[name]).astype(dtype).astype(np.float32)

    def got(x):
        return np.asarray(x, np.float32)

    p = "midlayer." if cfg.algorithm == "EAGLE3" else "layers.0."
    np.testing.assert_array_equal(got(params["fc"]), f("fc.weight").T)
    lp = jax.tree.map(lambda a: a[0], params["layers"])
    qkv = np.concatenate([f(p + f"self_attn.{x}_proj.weight").T for x in "qkv"], axis=1)
    np.testing.assert_array_equal(got(lp["wqkv"]), qkv)
    np.testing.assert_array_equal(got(lp["wo"]), f(p + "self_attn.o_proj.weight").T)
    np.testing.assert_array_equal(got(lp["mlp_norm"]), f(p + "post_attention_layernorm.weight"))
    gu = np.concatenate([f(p + "mlp.gate_proj.weight").T, f(p + "mlp.up_proj.weight").T], axis=1)
    np.testing.assert_array_equal(got(lp["w_gate_up"]), gu)
    np.testing.assert_array_equal(got(lp["w_down"]), f(p + "mlp.down_proj.weight").T)
    if cfg.fc_bias:
        np.testing.assert_array_equal(got(params["fc_bias"]), f("fc.bias"))
    if cfg.algorithm == "EAGLE3":
        np.testing.assert_array_equal(got(lp["attn_norm"]), f(p + "input_layernorm.weight"))
        np.testing.assert_array_equal(got(lp["hidden_norm"]), f(p + "hidden_norm.weight"))
        np.testing.assert_array_equal(got(params["final_norm"]), f("norm.weight"))
        np.testing.assert_array_equal(got(params["lm_head"]), f("lm_head.weight").T)
        assert params["d2t"].dtype == np.int32
        np.testing.assert_array_equal(np.asarray(params["d2t"]), t["d2t"])
    else:
        assert "attn_norm" not in lp  # EAGLE's only layer has no input norm
    if cfg.has_embed:
        np.testing.assert_array_equal(got(params["embed"]), f("embed_tokens.weight"))
    shapes = jax.tree.map(lambda x: tuple(x.shape), params)
    assert shapes == draft_param_shapes(cfg)


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


def test_eagle_safetensors(tmp_path):
    hf = hf_of("EAGLE")
    t = eagle_tiny.tiny_draft_tensors(TARGET, hf, seed=1, with_embed=True)
    cfg, params = load_draft_model(write_dir(tmp_path / "d", hf, t), TARGET, dtype=np.float32)
    assert cfg.algorithm == "EAGLE" and cfg.capture_layers == () and cfg.num_layers == 1
    assert cfg.fc_bias and cfg.has_embed and not cfg.has_lm_head
    assert cfg.draft_vocab_size == cfg.vocab_size == 320 and cfg.fc_in == 128
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_kv_heads) == (500000.0, 16, 2)
    assert "d2t" not in params and "final_norm" not in params
    check_values(cfg, params, t)


def test_model_prefix_is_stripped(tmp_path):
    hf = hf_of("EAGLE")
    t = eagle_tiny.tiny_draft_tensors(TARGET, hf)
    prefixed = {("model." + n if n.startswith("layers.") else n): a for n, a in t.items()}
    cfg, params = load_draft_model(write_dir(tmp_path / "a", hf, prefixed), TARGET, dtype=np.float32)
    check_values(cfg, params, t)
    prefixed["layers.0.mlp.up_proj.weight"] = t["layers.0.mlp.up_proj.weight"]
    with pytest.raises(Exception, match="has both 'model.layers.0.mlp.up_proj.weight' and"):
        load_draft_model(write_dir(tmp_path / "b", hf, prefixed), TARGET)


def test_eagle3_safetensors_sharded_with_d2t(tmp_path):
    path = eagle_tiny.make_tiny_draft(tmp_path / "d", TARGET, "EAGLE3", seed=2, draft_vocab_size=48, num_shards=2)
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    hf = json.loads(Path(path, "config.json").read_text())
    t = eagle_tiny.tiny_draft_tensors(TARGET, hf, seed=2)
    cfg, params = load_draft_model(path, TARGET, dtype=np.float32, algorithm="eagle3")
    assert cfg.algorithm == "EAGLE3" and cfg.draft_vocab_size == 48 and cfg.vocab_size == 320
    assert cfg.has_lm_head and not cfg.has_embed and not cfg.fc_bias and cfg.fc_in == 3 * 64
    # SGLang's eagle_config ids mean "output of layer id"; jspec's mean "entering layer i".
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]
    assert cfg.capture_layers == (0, 1, 2)
    assert params["layers"]["wqkv"].shape == (1, 2 * 64, 64 + 2 * 32)
    check_values(cfg, params, t)
    ids = np.arange(48) + np.asarray(params["d2t"])
    assert np.all(np.diff(ids) > 0) and ids.max() < 320 and t["t2d"][ids].all()


def test_eagle3_capture_layer_conventions(tmp_path):
    hf = hf_of("EAGLE3", DEEP_TARGET)
    t = eagle_tiny.tiny_draft_tensors(DEEP_TARGET, hf)
    del hf["eagle_config"]  # SGLang's default for an 8-layer target: [2, 4, 5], used as is
    cfg, _ = load_draft_model(write_dir(tmp_path / "a", hf, t), DEEP_TARGET)
    assert cfg.capture_layers == (2, 4, 5)
    hf["eagle_aux_hidden_state_layer_ids"] = [6, 1, 3]  # vLLM's top level: as is, sorted
    cfg, _ = load_draft_model(write_dir(tmp_path / "b", hf, t), DEEP_TARGET)
    assert cfg.capture_layers == (1, 3, 6)
    hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}  # SGLang's: +1, and it wins
    cfg, _ = load_draft_model(write_dir(tmp_path / "c", hf, t), DEEP_TARGET)
    assert cfg.capture_layers == (2, 4, 8)
    hf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}  # 9 > L
    with pytest.raises(Exception, match=r"capture layers \[2, 4, 9\].*within \[0, 8\]"):
        load_draft_model(write_dir(tmp_path / "e", hf, t), DEEP_TARGET)


def test_bin_layouts_written_by_torch(tmp_path):
    """EAGLE (float32, strided views) and EAGLE-3 (bfloat16, d2t int64, t2d bool)
    saved by torch.save, read by our torch-free reader."""
    hf1 = hf_of("EAGLE")
    t1 = eagle_tiny.tiny_draft_tensors(TARGET, hf1, seed=3)
    hf3 = hf_of("EAGLE3", draft_vocab_size=40)
    t3 = eagle_tiny.tiny_draft_tensors(TARGET, hf3, seed=4, with_embed=True)
    d1, d3 = tmp_path / "e1", tmp_path / "e3"
    for d, hf in ((d1, hf1), (d3, hf3)):
        eagle_tiny.write_draft_config(d, hf)
    torch_save_many(
        tmp_path, [(t1, d1 / "pytorch_model.bin", "float32", True), (t3, d3 / "pytorch_model.bin", "bfloat16", False)]
    )
    raw = read_torch_bin_file(d1 / "pytorch_model.bin")
    assert set(raw) == set(t1)
    for n in t1:  # views with swapped strides; vectors at offset 3 of zero-padded storages
        np.testing.assert_array_equal(raw[n], t1[n])
    assert raw["fc.weight"].strides == (4, 4 * 64)  # torch's t() view, not a copy
    cfg, params = load_draft_model(d1, TARGET, dtype=np.float32)
    assert cfg.algorithm == "EAGLE" and cfg.fc_bias
    check_values(cfg, params, t1)

    raw = read_torch_bin_file(d3 / "pytorch_model.bin")
    assert raw["midlayer.hidden_norm.weight"].dtype == ml_dtypes.bfloat16
    assert raw["d2t"].dtype == np.int64 and raw["t2d"].dtype == bool
    cfg, params = load_draft_model(d3, TARGET, dtype=np.float32)
    assert cfg.algorithm == "EAGLE3" and cfg.draft_vocab_size == 40 and cfg.has_embed
    check_values(cfg, params, t3, dtype=ml_dtypes.bfloat16)


def test_init_random_draft_params_matches_loaded_structure(tmp_path):
    for alg in ("EAGLE", "EAGLE3"):
        cfg, loaded = load_draft_model(eagle_tiny.make_tiny_draft(tmp_path / alg, TARGET, alg), TARGET)
        rnd = init_random_draft_params(cfg, jax.random.key(0), np.float32)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), rnd) == jax.tree.map(lambda x: (x.shape, x.dtype), loaded)
        if alg == "EAGLE3":
            ids = np.arange(cfg.draft_vocab_size) + np.asarray(rnd["d2t"])
            assert len(set(ids.tolist())) == cfg.draft_vocab_size and 0 <= ids.min() and ids.max() < 320


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_wrong_shape_names_tensor_expected_and_got(tmp_path):
    hf = hf_of("EAGLE3")
    t = eagle_tiny.tiny_draft_tensors(TARGET, hf)
    t["midlayer.self_attn.q_proj.weight"] = t["midlayer.self_attn.q_proj.weight"][:, :64]  # in = H, not 2H
    with pytest.raises(
        TensorShapeError,
        match=r"'midlayer.self_attn.q_proj.weight': expected \[64, 128\], "
        r"got \[64, 64\]",
    ):
        load_draft_model(write_dir(tmp_path / "a", hf, t), TARGET)
    wide = ModelConfig(**{**TARGET.__dict__, "hidden_size": 96})
    with pytest.raises(TensorShapeError, match="hidden_size is 64, but the target's hidden_size is 96"):
        load_draft_model(eagle_tiny.make_tiny_draft(tmp_path / "b", TARGET, "EAGLE"), wide)


def test_missing_tensor(tmp_path):
    hf = hf_of("EAGLE")
    t = eagle_tiny.tiny_draft_tensors(TARGET, hf)
    del t["layers.0.mlp.down_proj.weight"]
    with pytest.raises(MissingTensorError, match=r"missing 1 tensor\(s\).*'layers.0.mlp.down_proj.weight'"):
        load_draft_model(write_dir(tmp_path / "a", hf, t), TARGET)
    hf3 = hf_of("EAGLE3")
    t3 = eagle_tiny.tiny_draft_tensors(TARGET, hf3)
    del t3["lm_head.weight"]  # draft_vocab_size < vocab needs the head's own lm_head
    with pytest.raises(MissingTensorError, match="'lm_head.weight'"):
        load_draft_model(write_dir(tmp_path / "b", hf3, t3), TARGET)


def test_unknown_layout(tmp_path):
    rng = np.random.default_rng(0)
    t = {"encoder.weight": rng.standard_normal((4, 4)).astype(np.float32)}
    with pytest.raises(UnknownDraftLayoutError, match="neither an EAGLE head.*nor an EAGLE-3 head.*encoder.weight"):
        load_draft_model(write_dir(tmp_path / "a", hf_of("EAGLE"), t), TARGET)
    # A full target model given as the draft: layers but no fc.
    t = {
        "embed_tokens.weight": np.zeros((320, 64), np.float32),
        "norm.weight": np.ones(64, np.float32),
        "layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32),
    }
    with pytest.raises(UnknownDraftLayoutError, match="looks like a full model"):
        load_draft_model(write_dir(tmp_path / "b", {"architectures": ["LlamaForCausalLM"]}, t), TARGET)


def test_algorithm_mismatch(tmp_path):
    path = eagle_tiny.make_tiny_draft(tmp_path / "a", TARGET, "EAGLE")
    with pytest.raises(DraftAlgorithmMismatchError, match="is an EAGLE head.*but algorithm EAGLE3 was requested"):
        load_draft_model(path, TARGET, algorithm="EAGLE3")
    cfg, _ = load_draft_model(path, TARGET, algorithm="EAGLE2")  # EAGLE-2 uses EAGLE heads
    assert cfg.algorithm == "EAGLE"
    hf = hf_of("EAGLE3")
    t = eagle_tiny.tiny_draft_tensors(TARGET, hf_of("EAGLE"))
    with pytest.raises(DraftAlgorithmMismatchError, match=r"architectures \['LlamaForCausalLMEagle3'\] say EAGLE3"):
        load_draft_model(write_dir(tmp_path / "b", hf, t), TARGET)


def test_multi_layer_eagle_head_is_refused(tmp_path):
    path = eagle_tiny.make_tiny_draft(tmp_path / "a", TARGET, "EAGLE", num_layers=2)
    with pytest.raises(Exception, match="num_hidden_layers=2 are not supported"):
        load_draft_model(path, TARGET)


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _torch_like_zip(path: Path, payload: bytes) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


def test_bin_reader_rejects_non_whitelisted_globals(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.bin"
    _torch_like_zip(evil, pickle.dumps({"fc.weight": _Evil(str(marker))}, protocol=2))
    with pytest.raises(UnsafePickleError, match=r"refers to posix.system|refers to os.system|refers to nt.system"):
        read_torch_bin_file(evil)
    assert not marker.exists()
    # Through the directory loader too, and a plain non-torch file is named as such.
    d = tmp_path / "d"
    eagle_tiny.write_draft_config(d, hf_of("EAGLE"))
    os.replace(evil, d / "pytorch_model.bin")
    with pytest.raises(UnsafePickleError, match="not allowed"):
        load_draft_model(d, TARGET)
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(Exception, match="not a zip-format PyTorch checkpoint"):
        load_draft_model(d, TARGET)
    assert not marker.exists()

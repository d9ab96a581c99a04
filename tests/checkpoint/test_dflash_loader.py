"""DFlash drafter checkpoints: the published layout round-trips, its config fields are read
where the reference reads them, and what jspec does not implement is refused by name."""

import json

import jax
import numpy as np
import pytest

from jspec.checkpoint.dflash import (
    dflash_config_for,
    dflash_config_from_hf,
    dflash_hf_config,
    dflash_tensors,
    init_random_dflash_params,
    load_dflash_model,
    save_dflash,
)
from jspec.checkpoint.errors import CheckpointError, MissingTensorError
from jspec.checkpoint.files import write_safetensors
from jspec.config.dflash import default_target_layer_ids
from jspec.config.model import ModelConfig

TARGET = ModelConfig(
    family="qwen3",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=1e6,
    max_position_embeddings=512,
    qk_norm=True,
)


@pytest.fixture(scope="module")
def drafter():
    dcfg = dflash_config_for(TARGET, num_layers=2, block_size=8, mask_token_id=95)
    return dcfg, init_random_dflash_params(dcfg, jax.random.key(0))


def test_round_trip_through_the_published_layout(tmp_path, drafter):
    dcfg, params = drafter
    path = save_dflash(tmp_path / "d", dcfg, params, TARGET)
    with open(f"{path}/config.json") as f:
        hf = json.load(f)
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["block_size"] == 8
    assert hf["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [1, 3]}
    loaded_cfg, loaded = load_dflash_model(path, TARGET)
    assert loaded_cfg == dcfg and dcfg.capture_layers == (2, 4)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded, params)


def test_reference_field_places_and_defaults(drafter):
    dcfg, params = drafter
    hf = dflash_hf_config(dcfg, TARGET)
    inner = hf.pop("dflash_config")
    # block_size inside dflash_config, no target_layer_ids: the reference's default layers.
    hf["dflash_config"] = {"mask_token_id": inner["mask_token_id"], "block_size": 16}
    del hf["block_size"]
    got = dflash_config_from_hf(hf, TARGET)
    assert got.block_size == 16 and got.target_layer_ids == default_target_layer_ids(6, 2) == (1, 3)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's published drafter
    assert default_target_layer_ids(30, 1) == (15,)


def test_model_prefixed_names_are_read(tmp_path, drafter):
    dcfg, params = drafter
    path = tmp_path / "prefixed"
    path.mkdir()
    write_safetensors(str(path), {"model." + k: v for k, v in dflash_tensors(params, dcfg).items()})
    (path / "config.json").write_text(json.dumps(dflash_hf_config(dcfg, TARGET)))
    assert load_dflash_model(path, TARGET)[0] == dcfg


@pytest.mark.parametrize(
    "change,match",
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel' is not implemented"),
        ({"dflash_config": {"mask_token_id": 95, "conv_kernel_size": 2}}, "conv_kernel_size=2"),
        ({"dflash_config": {"mask_token_id": 95, "selector_rank": 8}}, "candidate selector"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding-window draft layers"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"dflash_config": {"target_layer_ids": [1, 3]}}, "no dflash_config.mask_token_id"),
        ({"num_target_layers": 36}, "36-layer target"),
        ({"dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 5]}}, "layers 0..4"),
        ({"hidden_size": 64}, "hidden size is 32"),
        ({"dflash_config": {"mask_token_id": 96}}, "not a row"),
        ({"dflash_config": {"mask_token_id": 95, "sample_from_anchor": False}}, "sample_from_anchor"),
    ],
)
def test_refused_by_name(drafter, change, match):
    dcfg, _ = drafter
    hf = {**dflash_hf_config(dcfg, TARGET), **change}
    with pytest.raises(CheckpointError, match=match):
        dflash_config_from_hf(hf, TARGET)


def test_missing_and_bias_tensors_are_refused(tmp_path, drafter):
    dcfg, params = drafter
    tensors = dflash_tensors(params, dcfg)
    for name, edit in (("missing", lambda t: t.pop("layers.1.self_attn.k_norm.weight")), ("bias", None)):
        t = dict(tensors)
        if edit is None:
            t["layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)
        else:
            edit(t)
        path = tmp_path / name
        path.mkdir()
        write_safetensors(str(path), t)
        (path / "config.json").write_text(json.dumps(dflash_hf_config(dcfg, TARGET)))
        with pytest.raises(MissingTensorError if name == "missing" else CheckpointError, match=name[:4]):
            load_dflash_model(path, TARGET)

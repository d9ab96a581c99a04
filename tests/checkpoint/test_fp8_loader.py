"""Reading FP8 checkpoints: each layout's scales become [in_blocks, out] columns, and what jspec
does not read is refused by name."""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jspec.checkpoint.files import read_hf_tensors, write_safetensors
from jspec.checkpoint.fp8 import Fp8Scheme, UnsupportedQuantizationError, fp8_scheme, scale_columns
from jspec.checkpoint.loader import load_model
from jspec.checkpoint.tiny import make_tiny_model
from jspec.testing.fp8 import write_fp8_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("fp8src") / "m"), seed=1, tokenizer=False)


def test_schemes_of_the_published_configs():
    assert fp8_scheme({}) is None
    assert fp8_scheme({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}) == Fp8Scheme(
        "weight_scale", None, True
    )
    deepseek = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert fp8_scheme({"quantization_config": deepseek}) == Fp8Scheme("weight_scale_inv", (128, 128), False)


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 8}}},
            },
            "not FP8",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "group"}}},
            },
            "strategy 'group'",
        ),
    ],
)
def test_unsupported_quantization_is_refused_by_name(qc, match):
    with pytest.raises(UnsupportedQuantizationError, match=match):
        fp8_scheme({"quantization_config": qc})


def test_scale_columns_of_each_granularity():
    w = np.zeros((6, 8), ml_dtypes.float8_e4m3fn)
    m = "model.layers.0.mlp.up_proj"
    tensor = {m + ".weight": w, m + ".weight_scale": np.array([0.5], np.float32)}
    np.testing.assert_array_equal(
        scale_columns(Fp8Scheme("weight_scale", None, False), tensor, m), np.full((1, 6), 0.5)
    )
    channel = {m + ".weight": w, m + ".weight_scale": np.arange(6, dtype=np.float32).reshape(6, 1)}
    np.testing.assert_array_equal(scale_columns(Fp8Scheme("weight_scale", None, False), channel, m), [np.arange(6)])
    # 4 x 4 blocks over [6, 8]: 2 x 2 scales, the last output block ragged.
    block = {m + ".weight": w, m + ".weight_scale_inv": np.array([[1, 2], [3, 4]], np.float32)}
    cols = scale_columns(Fp8Scheme("weight_scale_inv", (4, 4), False), block, m)
    np.testing.assert_array_equal(cols, [[1, 1, 1, 1, 3, 3], [2, 2, 2, 2, 4, 4]])
    with pytest.raises(Exception, match=r"expected \[2, 2\]"):
        scale_columns(
            Fp8Scheme("weight_scale_inv", (4, 4), False), {**block, m + ".weight_scale_inv": np.ones((2, 3))}, m
        )
    with pytest.raises(Exception, match="has no weight_scale"):
        scale_columns(Fp8Scheme("weight_scale", None, False), {m + ".weight": w}, m)
    with pytest.raises(Exception, match="static activation scheme needs a scalar input_scale"):
        scale_columns(Fp8Scheme("weight_scale", None, True), tensor, m)


def rewrite(path, edit):
    tensors = {n: np.asarray(a) for n, a in read_hf_tensors(path).items()}
    edit(tensors)
    os.remove(os.path.join(path, "model.safetensors"))
    write_safetensors(path, tensors)


def test_fp8_in_some_layers_only_and_fp8_lm_head_are_refused(src, tmp_path):
    path = write_fp8_checkpoint(src, tmp_path / "a", "ct_channel_dynamic")
    rewrite(path, lambda t: t.update({"model.layers.1.mlp.down_proj.weight": np.ones((64, 128), np.float32)}))
    with pytest.raises(UnsupportedQuantizationError, match="FP8 in some layers only"):
        load_model(path, dtype=jnp.float32)
    path = write_fp8_checkpoint(src, tmp_path / "b", "fp8_tensor_static")
    rewrite(path, lambda t: t.update({"lm_head.weight": t["lm_head.weight"].astype(ml_dtypes.float8_e4m3fn)}))
    with pytest.raises(UnsupportedQuantizationError, match="lm_head.weight in FP8"):
        load_model(path, dtype=jnp.float32)


def test_fp8_tensors_without_a_quantization_config_are_refused(src, tmp_path):
    path = write_fp8_checkpoint(src, tmp_path / "c", "fp8_block", block=(32, 32))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedQuantizationError, match="no quantization_config"):
        load_model(path, dtype=jnp.float32)


def test_converting_an_fp8_checkpoint_is_refused(src, tmp_path):
    from jspec.checkpoint.loader import convert_checkpoint

    path = write_fp8_checkpoint(src, tmp_path / "d", "ct_channel_dynamic")
    with pytest.raises(UnsupportedQuantizationError, match="orbax format is not implemented"):
        convert_checkpoint(path, tmp_path / "out", dtype=jnp.float32)


def test_an_fp8_pool_holds_twice_the_pages_of_bf16_in_the_same_bytes():
    from jspec.config.engine import EngineConfig
    from jspec.config.model import ModelConfig
    from jspec.engine.sizing import page_bytes, plan_pool

    cfg = ModelConfig("llama", 64, 64, 64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    pages = {
        kv: plan_pool(
            page_size=16, bytes_per_page=page_bytes(EngineConfig(kv_cache_dtype=kv), cfg, None, jnp.bfloat16)
        ).pages
        for kv in ("auto", "fp8_e4m3")
    }
    assert pages["fp8_e4m3"] == 2 * pages["auto"]

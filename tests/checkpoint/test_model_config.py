"""ModelConfig.from_hf on the config.json fields of the families past Llama: sliding windows,
RoPE scalings, the family switches, and refusals that name the feature."""

import dataclasses
import math

import numpy as np
import pytest

from jspec.config.errors import UnsupportedArchitectureError
from jspec.config.model import ModelConfig
from jspec.models.rope import inv_freq


def hf_config(arch="LlamaForCausalLM", **fields):
    base = dict(
        architectures=[arch],
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return {**base, **fields}


def test_mistral_7b_v01_window_does_not_cap_the_context():
    cfg = ModelConfig.from_hf(hf_config("MistralForCausalLM", sliding_window=4096, max_position_embeddings=32768))
    assert cfg.max_position_embeddings == 32768
    assert cfg.sliding_windows == (4096,) * 4 and cfg.smallest_window == 4096


@pytest.mark.parametrize(
    "fields,windows",
    [
        (dict(use_sliding_window=False, sliding_window=32768, max_window_layers=28), ()),  # Qwen2.5's hub config
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=4), ()),  # max_window_layers covers none
        (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), (0, 0, 8, 8)),
        (dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2), (0, 8, 0, 8)),
    ],
)
def test_qwen2_windows_follow_hf(fields, windows):
    cfg = ModelConfig.from_hf(hf_config("Qwen2ForCausalLM", **fields))
    assert cfg.sliding_windows == windows and cfg.max_position_embeddings == 4096


def test_gemma_hub_configs_without_layer_types():
    g2 = ModelConfig.from_hf(hf_config("Gemma2ForCausalLM", sliding_window=16, head_dim=16))
    assert g2.sliding_windows == (16, 0, 16, 0)
    assert g2.norm_layout == "sandwich" and g2.hidden_act == "gelu_tanh"
    assert g2.embedding_multiplier == 8.0 and g2.attention_scale == 16**-0.5  # query_pre_attn_scalar: head_dim
    g3 = ModelConfig.from_hf(
        hf_config(
            "Gemma3ForCausalLM",
            num_hidden_layers=6,
            sliding_window=16,
            sliding_window_pattern=3,
            query_pre_attn_scalar=64,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            final_logit_softcapping=None,
        )
    )
    assert g3.sliding_windows == (16, 16, 0, 16, 16, 0) and g3.qk_norm and g3.attention_scale == 0.125
    assert g3.rope_theta == 1e6 and g3.rope_scaling.rope_type == "linear"
    assert g3.sliding_rope_theta == 1e4 and g3.sliding_rope_scaling is None
    assert g3.final_logit_softcap is None and g3.max_position_embeddings == 8 * 4096


def test_rope_scalings_and_their_contexts():
    # Qwen2.5's long-context recipe: YaRN x4 over 32768 tokens.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = ModelConfig.from_hf(hf_config("Qwen2ForCausalLM", max_position_embeddings=32768, rope_scaling=yarn))
    assert cfg.max_position_embeddings == 131072
    assert math.isclose(cfg.rope_scaling.attention_factor, 0.1 * math.log(4.0) + 1.0)
    # transformers 5 folds theta and scaling into rope_parameters.
    cfg = ModelConfig.from_hf(hf_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}))
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.rope_type == "dynamic" and cfg.max_position_embeddings == 8192
    # Phi-3's "su" is LongRoPE; its pretraining length sits beside rope_scaling.
    su = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = ModelConfig.from_hf(
        hf_config(
            "Phi3ForCausalLM", max_position_embeddings=131072, original_max_position_embeddings=4096, rope_scaling=su
        )
    )
    rs = cfg.rope_scaling
    assert rs.rope_type == "longrope" and rs.original_max_position_embeddings == 4096
    assert math.isclose(rs.attention_factor, math.sqrt(1 + math.log(32) / math.log(4096)))
    np.testing.assert_allclose(inv_freq(1e4, 16, rs, long=True), inv_freq(1e4, 16, None) / 2, rtol=1e-6)


def test_family_switches():
    olmo = ModelConfig.from_hf(hf_config("Olmo2ForCausalLM"))
    assert olmo.norm_layout == "post" and olmo.qk_norm_whole and not olmo.qk_norm
    granite = ModelConfig.from_hf(
        hf_config(
            "GraniteForCausalLM",
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=8.0,
            attention_bias=True,
        )
    )
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logits_divisor) == (12.0, 0.22, 8.0)
    assert granite.sm_scale == 0.0078125 and granite.qkv_bias and granite.o_bias
    assert ModelConfig.from_hf(hf_config(attention_bias=True)).o_bias
    # HF's Mistral never gives its projections a bias, whatever attention_bias says.
    mistral = ModelConfig.from_hf(hf_config("MistralForCausalLM", attention_bias=True))
    assert not mistral.qkv_bias and not mistral.o_bias
    gemma = ModelConfig.from_hf(hf_config("GemmaForCausalLM", hidden_act="gelu", head_dim=16))
    assert gemma.hidden_act == "gelu_tanh" and gemma.norm_layout == "pre" and gemma.sm_scale == 0.25


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(rope_scaling={"rope_type": "mrope", "factor": 2.0}), "unsupported rope_scaling type 'mrope'"),
        (dict(hidden_act="relu"), "unsupported hidden_act 'relu'"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(sliding_window=8, layer_types=["chunked_attention"] * 4), "unsupported layer_types"),
    ],
)
def test_unimplemented_features_are_refused_by_name(fields, message):
    with pytest.raises(UnsupportedArchitectureError, match=message):
        ModelConfig.from_hf(hf_config("Qwen3ForCausalLM", **fields))


def test_new_fields_survive_a_converted_checkpoints_json():
    """convert_checkpoint writes the config as JSON: windows, NoPE flags and RoPE scalings
    (their factor lists included) come back equal and hashable (a jit static)."""
    import json

    from jspec.checkpoint.loader import config_from_json, config_to_json
    from jspec.config.model import RopeScaling

    cfg = ModelConfig.from_hf(
        hf_config(
            "Gemma3ForCausalLM",
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=4,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        )
    )
    cfg = ModelConfig(
        **{
            **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
            "rope_layers": (True, False),
            "sliding_rope_scaling": RopeScaling(
                2.0, rope_type="longrope", short_factor=(1.0,) * 8, long_factor=(2.0,) * 8
            ),
        }
    )
    back = config_from_json(json.loads(json.dumps(config_to_json(cfg))))
    assert back == cfg and hash(back) == hash(cfg)


def test_gpt_oss_switches_and_what_it_refuses():
    """gpt-oss without layer_types alternates windows from layer 0 (HF's default); every layer
    is sparse, with biases and the clamped SwiGLU; what jspec cannot run with sinks is refused."""
    from jspec.checkpoint.fp8 import UnsupportedQuantizationError
    from jspec.checkpoint.mxfp4 import check_mxfp4_family
    from jspec.distributed.dp_attention import check_dp_config
    from jspec.distributed.tensor_parallel import check_tp_config

    cfg = ModelConfig.from_hf(
        hf_config("GptOssForCausalLM", sliding_window=128, num_local_experts=8, num_experts_per_tok=2)
    )
    assert cfg.sliding_windows == (128, 0, 128, 0) and cfg.attention_sinks
    assert cfg.moe_layers == (0, 1, 2, 3) and cfg.moe_biases and cfg.norm_topk_prob
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.moe_intermediate_size) == (7.0, 1.702, 128)
    with pytest.raises(ValueError, match="attention sinks"):
        check_tp_config(cfg, 2)
    with pytest.raises(ValueError, match="attention sinks"):
        check_dp_config(cfg, 2, 1)
    with pytest.raises(UnsupportedQuantizationError, match="'mxfp4' is supported for gpt-oss experts only"):
        check_mxfp4_family("llama")

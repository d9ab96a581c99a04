"""NEXTN's flags and refusals: --speculative-algorithm NEXTN reads its draft from the target's own
checkpoint by default; DeepSeek models refuse by name what they do not support yet."""

import pytest

from jspec.config.errors import UnsupportedArchitectureError
from jspec.config.model import ModelConfig
from jspec.server.args import build_parser, engine_config


def test_nextn_flag_drafts_from_the_model_path():
    args = build_parser().parse_args(["--model-path", "/ckpt/dsv3", "--speculative-algorithm", "NEXTN"])
    spec = engine_config(args).speculative
    assert spec.algorithm == "NEXTN" and spec.draft_model_path == "/ckpt/dsv3"


def test_other_methods_still_need_a_draft_path():
    args = build_parser().parse_args(["--model-path", "/ckpt/m", "--speculative-algorithm", "EAGLE3"])
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        engine_config(args)


V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
)


def test_deepseek_configs_and_refusals():
    cfg = ModelConfig.from_hf(V3)
    assert cfg.family == "deepseek_v3" and cfg.moe_layers == (1,) and cfg.deepseek.latent_dim == 24
    assert cfg.num_kv_heads == 1 and cfg.head_dim == 16
    with pytest.raises(UnsupportedArchitectureError, match="DeepseekV32ForCausalLM is not supported"):
        ModelConfig.from_hf({**V3, "architectures": ["DeepseekV32ForCausalLM"]})
    with pytest.raises(UnsupportedArchitectureError, match="router topk_method"):
        ModelConfig.from_hf({**V3, "topk_method": "greedy"})
    with pytest.raises(UnsupportedArchitectureError, match="norm_topk_prob"):
        ModelConfig.from_hf({**V3, "architectures": ["DeepseekV2ForCausalLM"], "norm_topk_prob": True})


def test_deepseek_engine_refusals():
    from jspec.config.engine import EngineConfig
    from jspec.engine.sizing import check_parallel

    cfg = ModelConfig.from_hf(V3)
    with pytest.raises(ValueError, match="tensor / expert parallelism and DP attention are not implemented"):
        check_parallel(EngineConfig(tp_size=2, ep_size=2), cfg)
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        check_parallel(EngineConfig(enable_lora=True), cfg)
    with pytest.raises(ValueError, match="FP8 KV cache is not supported"):
        check_parallel(EngineConfig(kv_cache_dtype="fp8_e4m3"), cfg)

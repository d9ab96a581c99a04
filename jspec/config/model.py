"""Configuration dataclasses.

`ModelConfig` describes a Llama-family decoder (the shapes and the few switches
that tell Llama, Mistral, Qwen2 and Qwen3 apart), optionally with Mixture-of-Experts
MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral: see models/moe.py). It is frozen and hashable
so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jspec.config.deepseek import (
    DEEPSEEK_ARCHITECTURES,
    REFUSED_DEEPSEEK_ARCHITECTURES,
    DeepseekConfig,
    deepseek_fields,
)

# HF `architectures[0]` -> jspec family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "MiMoForCausalLM": "qwen2",  # Qwen2 with multi-token-prediction layers (model.mtp_layers)
}


class UnsupportedArchitectureError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "qwen2_moe" | "qwen3_moe" | "mixtral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm on each q and k head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (num_experts == 0: a dense model). Layers in moe_layers replace
    # their SwiGLU MLP (intermediate_size) by num_experts experts of moe_intermediate_size,
    # num_experts_per_tok of them per token, weighted by the router's softmax over all
    # experts restricted to the chosen ones (renormalised to sum 1 when norm_topk_prob),
    # plus, when shared_expert_intermediate_size > 0, Qwen2-MoE's sigmoid-gated shared expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # DeepSeek-V3: multi-head latent attention and its router (config/deepseek.py); None for
    # the Llama family. num_mtp_layers: the checkpoint's multi-token-prediction layers
    # (model.layers.{num_layers + i}), the NEXTN draft.
    deepseek: DeepseekConfig | None = None
    num_mtp_layers: int = 0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        # Lists (from JSON) would make the config unhashable, so unusable as a jit static.
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        if self.moe_layers:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size < 1:
                raise ValueError("an MoE config needs moe_intermediate_size >= 1")
            if not all(0 <= i < self.num_layers for i in self.moe_layers):
                raise ValueError(f"moe_layers {self.moe_layers} out of range for {self.num_layers} layers")

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers with a plain SwiGLU MLP (all of them in a dense model)."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a config from a HF `config.json` dict; raises on anything unsupported."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in DEEPSEEK_ARCHITECTURES:
            return cls(**deepseek_fields(arch, hf))
        if arch in REFUSED_DEEPSEEK_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{arch} is not supported yet; of the DeepSeek family jspec runs {sorted(DEEPSEEK_ARCHITECTURES)}"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {arch!r} (config.json 'architectures' = {archs!r}); "
                f"jspec supports {sorted({**SUPPORTED_ARCHITECTURES, **DEEPSEEK_ARCHITECTURES})}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_scaling = None
        rs = hf.get("rope_scaling") or None
        if rs is None and isinstance(hf.get("rope_parameters"), dict):
            rs = hf["rope_parameters"]  # transformers >= 5 folds rope_theta and scaling here
        if rs is not None:
            rope_type = rs.get("rope_type", rs.get("type", "default"))
            if rope_type == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif rope_type != "default":
                raise UnsupportedArchitectureError(
                    f"unsupported rope_scaling type {rope_type!r}; jspec supports 'llama3' and none"
                )
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
            rope_theta = hf["rope_parameters"].get("rope_theta")
        max_pos = int(hf.get("max_position_embeddings", 4096))
        # Sliding-window attention equals full attention while the context fits
        # in the window, so a window is honoured by capping the context.
        window = hf.get("sliding_window")
        use_window = hf.get("use_sliding_window")
        if use_window is None:  # transformers 5 writes null for Mistral, which always uses its window
            use_window = family in ("mistral", "mixtral")
        if window and use_window:
            max_pos = min(max_pos, int(window))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        qkv_bias = family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
        if hf.get("attention_bias") and not qkv_bias:
            raise UnsupportedArchitectureError("attention_bias=true is supported only for Qwen2 (q/k/v bias)")
        moe = _moe_fields(family, hf)
        if hf.get("mlp_bias"):
            raise UnsupportedArchitectureError("mlp_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu'")
        return cls(
            family=family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(num_heads),
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0) if arch == "MiMoForCausalLM" else 0,
            **moe,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in model directory {os.fspath(path)!r}")
        with open(cfg_path) as f:
            return cls.from_hf(json.load(f))


def _moe_fields(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's MoE fields from an HF config.json (empty for a dense family).

    Qwen2/3-MoE: experts on layers where (i + 1) % decoder_sparse_step == 0 and i is not
    in mlp_only_layers (HF's Qwen3MoeDecoderLayer), norm_topk_prob as configured (HF's
    default False). Mixtral: every layer, always renormalised (softmax over the top-k
    logits, which is HF's softmax-then-topk-then-renormalise). transformers 5 may save
    the expert count as num_local_experts for either family.
    """
    if family not in ("qwen2_moe", "qwen3_moe", "mixtral"):
        return {}
    n = hf.get("num_experts", hf.get("num_local_experts"))
    if n is None:
        raise UnsupportedArchitectureError(f"{family} config.json without num_experts / num_local_experts")
    if int(n) == 0:  # HF builds every layer dense then
        return {}
    L = int(hf["num_hidden_layers"])
    if family == "mixtral":
        layers, norm, inter, shared = tuple(range(L)), True, int(hf["intermediate_size"]), 0
    else:
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        skip = set(int(i) for i in (hf.get("mlp_only_layers") or ()))
        layers = tuple(i for i in range(L) if (i + 1) % step == 0 and i not in skip)
        norm = bool(hf.get("norm_topk_prob", False))
        inter = int(hf["moe_intermediate_size"])
        shared = int(hf.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return dict(
        num_experts=int(n),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=inter,
        norm_topk_prob=norm,
        moe_layers=layers,
        shared_expert_intermediate_size=shared,
    )

"""Configuration dataclasses.

`ModelConfig` describes a Llama-family decoder (the shapes and the switches that tell
Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi-3, OLMo 2, Granite and SmolLM3 apart), optionally with
Mixture-of-Experts MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss: see models/moe.py). It is frozen
and hashable so it can be a static argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jspec.config.deepseek import (
    DEEPSEEK_ARCHITECTURES,
    REFUSED_DEEPSEEK_ARCHITECTURES,
    DeepseekConfig,
    deepseek_fields,
)
from jspec.config.errors import UnsupportedArchitectureError

# HF `architectures[0]` -> jspec family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "MiMoForCausalLM": "qwen2",  # Qwen2 with multi-token-prediction layers (model.mtp_layers)
    "GptOssForCausalLM": "gpt_oss",
}
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")
# Families whose every layer uses config.json's sliding_window (HF ignores layer_types there).
_WINDOW_EVERY_LAYER = ("mistral", "mixtral", "phi3")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling (HF's rope_scaling / rope_parameters), computed in models/rope.py.

    rope_type "llama3" (Llama 3.1's smooth wavelength blend), "linear" (positions divided by
    factor), "dynamic" (NTK: the base grows past original_max_position_embeddings), "yarn"
    (interpolate slow dimensions, keep fast ones; cos and sin times attention_factor),
    "longrope" (Phi-3's per-dimension short / long factors, "su" in old configs).
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # a value of SUPPORTED_ARCHITECTURES
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
    # Sliding-window attention: per layer, how many of the latest positions (the query's own
    # included) a query sees; 0 for full attention. Empty: no layer has a window.
    sliding_windows: tuple[int, ...] = ()
    # The rotated share of each head (Phi-4-mini: 0.75); the rest passes through unrotated.
    partial_rotary_factor: float = 1.0
    # Gemma 3: sliding-window layers rotate with their own base (and scaling); None: as the others.
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: RopeScaling | None = None
    # SmolLM3's NoPE layers: per layer, whether it rotates q and k. Empty: every layer does.
    rope_layers: tuple[bool, ...] = ()
    # Switches of the families past Llama (their HF config names in the comments).
    hidden_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # "pre": RMSNorm before each sublayer; "sandwich": also on each sublayer's output (Gemma 2/3);
    # "post": on each sublayer's output only (OLMo 2).
    norm_layout: str = "pre"
    qk_norm_whole: bool = False  # OLMo 2: q_norm / k_norm over the whole projection, not per head
    o_bias: bool = False  # attention_bias on o_proj too (Llama, Qwen3, Granite)
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size) in the weights' dtype; Granite
    residual_multiplier: float = 1.0  # Granite: each sublayer's output is scaled before the add
    attention_scale: float | None = None  # None: head_dim**-0.5 (query_pre_attn_scalar, attention_multiplier)
    logits_divisor: float = 1.0  # Granite's logits_scaling
    attn_logit_softcap: float | None = None  # Gemma 2: c * tanh(logits / c) on attention logits
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    # DeepSeek-V3: multi-head latent attention and its router (config/deepseek.py); None for
    # the Llama family. num_mtp_layers: the checkpoint's multi-token-prediction layers
    # (model.layers.{num_layers + i}), the NEXTN draft.
    deepseek: DeepseekConfig | None = None
    num_mtp_layers: int = 0
    # gpt-oss: a learned logit per query head joins each attention softmax's denominator (sinks).
    attention_sinks: bool = False
    # gpt-oss's experts: biases on the router and on both expert projections, and the clamped
    # SwiGLU: gate clamped above and up on both sides at swiglu_limit, (up + 1) * gate *
    # sigmoid(swiglu_alpha * gate). None: the plain SwiGLU.
    moe_biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        # Lists (from JSON) would make the config unhashable, so unusable as a jit static.
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        rope_layers = tuple(bool(r) for r in self.rope_layers)
        object.__setattr__(self, "rope_layers", () if all(rope_layers) else rope_layers)
        if self.rope_layers and len(self.rope_layers) != self.num_layers:
            raise ValueError(f"rope_layers {self.rope_layers} must hold one flag per layer ({self.num_layers})")
        windows = tuple(int(w) for w in self.sliding_windows)
        object.__setattr__(self, "sliding_windows", windows if any(windows) else ())
        if windows and (len(windows) != self.num_layers or min(windows) < 0):
            raise ValueError(f"sliding_windows {windows} must hold one window >= 0 per layer ({self.num_layers})")
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
    def smallest_window(self) -> int | None:
        """The narrowest sliding window of any layer (None: every layer attends to everything)."""
        return min((w for w in self.sliding_windows if w), default=None)

    @property
    def sm_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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
        max_pos = int(hf.get("max_position_embeddings", 4096))
        rope = _rope_fields(hf, int(head_dim), max_pos)
        max_pos = rope.pop("context")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        qkv_bias = family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
        # Llama, Qwen3, OLMo 2, Granite, Phi-3 and Gemma read attention_bias for q, k, v and o;
        # HF's Mistral, Mixtral and Qwen2(-MoE) classes never give o_proj a bias.
        o_bias = bool(hf.get("attention_bias")) and family not in ("mistral", "mixtral", "qwen2", "qwen2_moe")
        qkv_bias = qkv_bias or o_bias
        moe = _moe_fields(family, hf)
        if hf.get("mlp_bias"):
            raise UnsupportedArchitectureError("mlp_bias=true is not supported")
        default_act = "gelu_pytorch_tanh" if family in GEMMA_FAMILIES else "silu"  # HF's config defaults
        if family in ("gemma2", "gemma3"):  # their MLPs read hidden_activation
            act_name = hf.get("hidden_activation") or default_act
        else:
            act_name = hf.get("hidden_act") or default_act
        if family == "gemma" and act_name == "gelu":  # HF reads Gemma's legacy "gelu" as the tanh form
            act_name = "gelu_pytorch_tanh"
        if act_name not in ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"unsupported hidden_act {act_name!r}; jspec supports {sorted(ACTIVATIONS)}"
            )
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
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_windows=_sliding_windows(family, hf),
            hidden_act=ACTIVATIONS[act_name],
            o_bias=o_bias,
            **rope,
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0) if arch == "MiMoForCausalLM" else 0,
            **moe,
            **_family_fields(family, hf),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in model directory {os.fspath(path)!r}")
        with open(cfg_path) as f:
            return cls.from_hf(json.load(f))


def _family_fields(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The switches of the families past Llama, from their config.json fields; refuses the
    ones jspec does not implement, by name."""
    fields: dict[str, Any] = {}
    if family in GEMMA_FAMILIES:
        fields["embedding_multiplier"] = float(hf["hidden_size"]) ** 0.5
        if family != "gemma":
            fields["norm_layout"] = "sandwich"
            fields["attention_scale"] = float(hf.get("query_pre_attn_scalar") or hf.get("head_dim")) ** -0.5
        fields["attn_logit_softcap"] = _positive(hf.get("attn_logit_softcapping"))
        fields["final_logit_softcap"] = _positive(hf.get("final_logit_softcapping"))
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedArchitectureError("use_bidirectional_attention=true is not supported (a decoder only)")
    if family == "smollm3":
        L = int(hf["num_hidden_layers"])
        flags = hf.get("no_rope_layers")  # 1: the layer uses RoPE (HF's naming)
        if flags is None:
            interval = int(hf.get("no_rope_layer_interval", 4))
            flags = [(i + 1) % interval != 0 for i in range(L)]
        fields["rope_layers"] = tuple(bool(f) for f in flags)
    if family == "olmo2":
        fields.update(norm_layout="post", qk_norm_whole=True)
    if family == "gpt_oss":
        fields["attention_sinks"] = True
    if family == "granite":
        fields.update(
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            attention_scale=float(hf.get("attention_multiplier", 1.0)),
            logits_divisor=float(hf.get("logits_scaling", 1.0)),
        )
    return fields


def _positive(value) -> float | None:
    return float(value) if value else None


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope_fields(hf: dict[str, Any], head_dim: int, max_pos: int) -> dict[str, Any]:
    """ModelConfig's RoPE fields from config.json (rope_theta + rope_scaling, or transformers 5's
    rope_parameters, possibly one per layer type), plus "context": the longest sequence the
    scaling serves. Linear, dynamic and YaRN scaling stretch the original context by their
    factor (as vLLM reads them); LongRoPE and Llama 3 configs already state the long one."""
    params = hf.get("rope_parameters")
    nested = isinstance(params, dict) and isinstance(params.get("full_attention"), dict)
    if nested:
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedArchitectureError(f"unsupported rope_parameters layer types {unknown}")
        main = params["full_attention"]
    else:
        main = hf.get("rope_scaling") or (params if isinstance(params, dict) else None) or {}
    theta = hf.get("rope_theta") or main.get("rope_theta")
    theta = float(theta if theta is not None else 10000.0)
    scaling, context = _rope_scaling(hf, main, head_dim, max_pos)
    fields = dict(
        rope_theta=theta,
        rope_scaling=scaling,
        context=context,
        partial_rotary_factor=float(hf.get("partial_rotary_factor", main.get("partial_rotary_factor", 1.0)) or 1.0),
    )
    local = params.get("sliding_attention") if nested else None
    if local is None and hf.get("rope_local_base_freq") is not None:  # Gemma 3 before transformers 5
        local = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    if local is not None:
        fields["sliding_rope_theta"] = float(local.get("rope_theta", theta))
        fields["sliding_rope_scaling"] = _rope_scaling(hf, local, head_dim, max_pos)[0]
    return fields


def _rope_scaling(hf: dict[str, Any], rs: dict[str, Any], head_dim: int, max_pos: int):
    """(RopeScaling or None, context) of one rope dict, with HF's defaults."""
    kind = rs.get("rope_type", rs.get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in ROPE_TYPES:
        raise UnsupportedArchitectureError(f"unsupported rope_scaling type {kind!r}; jspec supports {ROPE_TYPES}")
    if kind == "default":
        return None, max_pos
    # Phi-3 keeps the pretraining length beside rope_scaling, and HF gives that priority.
    original = hf.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings") or max_pos
    original = int(original)
    factor = rs.get("factor")
    if kind == "llama3":
        return RopeScaling(
            factor=float(factor),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=original,
        ), max_pos
    if kind == "linear":
        return RopeScaling(float(factor), rope_type="linear"), int(max_pos * float(factor))
    if kind == "dynamic":
        # HF's dynamic NTK measures growth against max_position_embeddings itself.
        return RopeScaling(float(factor), rope_type="dynamic", original_max_position_embeddings=max_pos), int(
            max_pos * float(factor)
        )
    factor = float(factor) if factor is not None else max_pos / original
    attention = rs.get("attention_factor")
    if kind == "yarn":
        if attention is None:
            mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")

            def yarn_mscale(scale, m=1.0):
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attention = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else yarn_mscale(factor)
            )
        scaling = RopeScaling(
            factor,
            rope_type="yarn",
            original_max_position_embeddings=original,
            beta_fast=float(rs.get("beta_fast") or 32),
            beta_slow=float(rs.get("beta_slow") or 1),
            truncate=bool(rs.get("truncate", True)),
            attention_factor=float(attention),
        )
        return scaling, max(max_pos, int(original * factor))
    # longrope
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    rotary = int(head_dim * float(hf.get("partial_rotary_factor", rs.get("partial_rotary_factor", 1.0)) or 1.0))
    for name in ("short_factor", "long_factor"):
        if len(rs[name]) != rotary // 2:
            raise UnsupportedArchitectureError(f"longrope {name} has {len(rs[name])} entries; expected {rotary // 2}")
    scaling = RopeScaling(
        factor,
        rope_type="longrope",
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        short_factor=tuple(rs["short_factor"]),
        long_factor=tuple(rs["long_factor"]),
    )
    return scaling, max_pos


def _sliding_windows(family: str, hf: dict[str, Any]) -> tuple[int, ...]:
    """Per-layer sliding windows (0: full attention) as HF's modeling code applies them.

    Mistral, Mixtral and Phi-3 window every layer when sliding_window is set. The others follow
    layer_types (transformers 5 writes it), else their HF default: Gemma 2 alternates, Gemma 3
    keeps every sliding_window_pattern-th layer global, Qwen windows the layers from
    max_window_layers on when use_sliding_window."""
    window = hf.get("sliding_window")
    L = int(hf["num_hidden_layers"])
    if not window:
        return ()
    window = int(window)
    if family in _WINDOW_EVERY_LAYER:
        return (window,) * L
    if hf.get("use_sliding_window") is False:  # Qwen's switch, off: HF drops the window
        return ()
    if family == "smollm3" and not hf.get("use_sliding_window"):  # its switch is off by default
        return ()
    types = hf.get("layer_types")
    if types is None and family in ("gemma2", "gpt_oss"):  # HF's default: sliding, full, sliding, ...
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if types is None and family == "gemma3":  # every sliding_window_pattern-th layer full
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    if types is not None:
        if len(types) != L:
            raise UnsupportedArchitectureError(f"layer_types has {len(types)} entries for {L} layers")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedArchitectureError(f"unsupported layer_types {unknown}")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if not hf.get("use_sliding_window", False):
        return ()
    first = int(hf.get("max_window_layers", L))
    return tuple(window if i >= first else 0 for i in range(L))


def _moe_fields(family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's MoE fields from an HF config.json (empty for a dense family).

    Qwen2/3-MoE: experts on layers where (i + 1) % decoder_sparse_step == 0 and i is not
    in mlp_only_layers (HF's Qwen3MoeDecoderLayer), norm_topk_prob as configured (HF's
    default False). Mixtral: every layer, always renormalised (softmax over the top-k
    logits, which is HF's softmax-then-topk-then-renormalise). transformers 5 may save
    the expert count as num_local_experts for either family.
    """
    if family == "gpt_oss":  # every layer sparse; softmax over the top-k logits, as Mixtral's
        L = int(hf["num_hidden_layers"])
        return dict(
            num_experts=int(hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=tuple(range(L)),
            moe_biases=True,
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        )
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

"""DeepSeek-V3's (and V2's) architecture switches: multi-head latent attention, its YaRN RoPE, and the
grouped sigmoid router (models/deepseek.py runs them)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jspec.config.errors import UnsupportedArchitectureError

DEEPSEEK_ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
# Refused by name: V3.2's sparse attention (its indexer) is not built.
REFUSED_DEEPSEEK_ARCHITECTURES = ("DeepseekV32ForCausalLM",)
# Router per family: V3 "noaux_tc" (sigmoid scores + correction bias, groups scored by their two
# best); V2 "greedy" or "group_limited_greedy" (softmax, groups scored by their best).
V3_TOPK_METHODS, V2_TOPK_METHODS = ("noaux_tc",), ("greedy", "group_limited_greedy")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: queries straight from q_proj (V2-Lite), else q_a -> norm -> q_b
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... rather than halves
    # YaRN ("rope_type": "yarn"); factor 1 means plain RoPE.
    yarn_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_truncate: bool = True
    yarn_attention_factor: float = 1.0  # cos and sin are scaled by it
    # Router: "noaux_tc" (V3): sigmoid scores plus a correction bias choose topk_group of n_group
    # expert groups (a group scores its two best), then the top k inside them, weights from the
    # raw scores. "group_limited_greedy" (V2): softmax scores, groups scored by their best;
    # "greedy" (V2-Lite): softmax top k.
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    @property
    def latent_dim(self) -> int:
        """Cache width per token: the compressed KV plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.yarn_factor != 1.0 and self.yarn_mscale_all_dim:
            scale *= yarn_mscale(self.yarn_factor, self.yarn_mscale_all_dim) ** 2
        return scale


def deepseek_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's keyword arguments for a DeepSeek-V3 config.json (HF's DeepseekV3Config)."""
    if hf.get("attention_bias"):
        raise UnsupportedArchitectureError("DeepSeek with attention_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu'")
    v3 = arch == "DeepseekV3ForCausalLM"
    topk_method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    allowed = V3_TOPK_METHODS if v3 else V2_TOPK_METHODS
    if topk_method not in allowed or scoring != ("sigmoid" if v3 else "softmax"):
        raise UnsupportedArchitectureError(
            f"{arch} router topk_method={topk_method!r} scoring_func={scoring!r} is not supported; jspec runs "
            f"{allowed} with {'sigmoid' if v3 else 'softmax'} scores"
        )
    if not v3 and hf.get("norm_topk_prob"):
        # transformers' DeepseekV2 never renormalises; refused rather than guessed.
        raise UnsupportedArchitectureError("DeepSeek-V2 with norm_topk_prob=true is not supported")
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta") or rs.get("rope_theta") or 10000.0
    yarn = yarn_fields(hf, rs)
    n_experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    if not n_experts:
        raise UnsupportedArchitectureError("DeepSeek config without n_routed_experts")
    L = int(hf["num_hidden_layers"])
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    if int(hf.get("moe_layer_freq", 1) or 1) != 1:
        raise UnsupportedArchitectureError("DeepSeek moe_layer_freq != 1 is not supported")
    n_shared = int(hf.get("n_shared_experts") or 0)
    ds = DeepseekConfig(
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,  # V2: complex pairs
        topk_method=topk_method,
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_shared_experts=n_shared,
        **yarn,
    )
    if n_experts % ds.n_group or ds.n_group < ds.topk_group:
        raise UnsupportedArchitectureError(f"n_group {ds.n_group} must divide n_routed_experts and be >= topk_group")
    top_k = int(hf["num_experts_per_tok"])
    if ds.topk_method != "greedy" and top_k > ds.topk_group * (n_experts // ds.n_group):
        raise UnsupportedArchitectureError(
            f"num_experts_per_tok {top_k} exceeds the experts of the topk_group={ds.topk_group} kept groups"
        )
    moe_inter = int(hf["moe_intermediate_size"])
    return dict(
        family=DEEPSEEK_ARCHITECTURES[arch],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=L,
        num_heads=int(hf["num_attention_heads"]),
        num_kv_heads=1,  # one latent "head" shared by every query head
        head_dim=ds.qk_head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos(hf.get("eos_token_id")),
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if v3 else False,
        moe_layers=tuple(range(first_dense, L)),
        shared_expert_intermediate_size=moe_inter * n_shared,
        num_mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
        deepseek=ds,
    )


def yarn_fields(hf: dict[str, Any], rs: dict[str, Any]) -> dict[str, Any]:
    """DeepseekConfig's yarn_* fields from config.json's rope scaling rs (none without YaRN)."""
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "yarn":
        original = int(rs["original_max_position_embeddings"])
        factor = rs.get("factor")
        factor = float(factor) if factor is not None else hf["max_position_embeddings"] / original
        mscale, mscale_all = float(rs.get("mscale") or 0.0), float(rs.get("mscale_all_dim") or 0.0)
        attention_factor = rs.get("attention_factor")
        if attention_factor is None:  # transformers' rule
            attention_factor = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else yarn_mscale(factor)
            )
        return dict(
            yarn_factor=factor,
            yarn_original_max_position_embeddings=original,
            yarn_beta_fast=float(rs.get("beta_fast") or 32),
            yarn_beta_slow=float(rs.get("beta_slow") or 1),
            yarn_mscale=mscale,
            yarn_mscale_all_dim=mscale_all,
            yarn_truncate=bool(rs.get("truncate", True)),
            yarn_attention_factor=float(attention_factor),
        )
    if rope_type != "default":
        raise UnsupportedArchitectureError(f"DeepSeek rope type {rope_type!r} is not supported; only 'yarn' and none")
    return {}


def _eos(eos) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))

"""DeepSeek-V3 checkpoints: HF tensors -> models/deepseek.py's per-layer params, and the
multi-token-prediction layers (model.layers.{num_hidden_layers + i}) -> the NEXTN draft's.

kv_b_proj [heads * (nope + v), kv_lora_rank] is split per head into W_UK [heads, nope, rank]
and W_UV [heads, v, rank], the layout both MLA forms read (kernels/mla_ref.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.errors import CheckpointError, MissingTensorError, TensorShapeError
from jspec.checkpoint.files import read_hf_tensors
from jspec.checkpoint.progress import peek
from jspec.config.model import ModelConfig


def _attention_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    ds, H, nh = cfg.deepseek, cfg.hidden_size, cfg.num_heads
    shapes = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.kv_a_proj_with_mqa.weight": (ds.latent_dim, H),
        "self_attn.kv_a_layernorm.weight": (ds.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (nh * (ds.qk_nope_head_dim + ds.v_head_dim), ds.kv_lora_rank),
        "self_attn.o_proj.weight": (H, nh * ds.v_head_dim),
    }
    if ds.q_lora_rank:
        shapes["self_attn.q_a_proj.weight"] = (ds.q_lora_rank, H)
        shapes["self_attn.q_a_layernorm.weight"] = (ds.q_lora_rank,)
        shapes["self_attn.q_b_proj.weight"] = (nh * ds.qk_head_dim, ds.q_lora_rank)
    else:
        shapes["self_attn.q_proj.weight"] = (nh * ds.qk_head_dim, H)
    return shapes


def _mlp_shapes(cfg: ModelConfig, sparse: bool) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    if not sparse:
        I = cfg.intermediate_size
        return {"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes = {"mlp.gate.weight": (E, H)}
    if cfg.deepseek.topk_method == "noaux_tc":
        shapes["mlp.gate.e_score_correction_bias"] = (E,)
    for e in range(E):
        shapes[f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
        shapes[f"mlp.experts.{e}.up_proj.weight"] = (I, H)
        shapes[f"mlp.experts.{e}.down_proj.weight"] = (H, I)
    if Is:
        shapes["mlp.shared_experts.gate_proj.weight"] = (Is, H)
        shapes["mlp.shared_experts.up_proj.weight"] = (Is, H)
        shapes["mlp.shared_experts.down_proj.weight"] = (H, Is)
    return shapes


MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    return {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H), "shared_head.norm.weight": (H,)}


def hf_shapes(cfg: ModelConfig, with_mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config needs ([out, in]), with the MTP layers when asked."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers + (cfg.num_mtp_layers if with_mtp else 0)):
        p = f"model.layers.{i}."
        layer = {**_attention_shapes(cfg), **_mlp_shapes(cfg, i in cfg.moe_layers or i >= cfg.num_layers)}
        if i >= cfg.num_layers:
            layer.update(_mtp_shapes(cfg))
        shapes.update({p + n: s for n, s in layer.items()})
    return shapes


def check_tensors(cfg: ModelConfig, tensors: Mapping[str, Any], where: str, with_mtp: bool = False) -> None:
    if any(n.endswith("weight_scale_inv") for n in tensors):
        raise CheckpointError(
            f"checkpoint {where}: FP8 block-scaled DeepSeek weights (weight_scale_inv) are not supported here; "
            "use a bfloat16 checkpoint"
        )
    expected = hf_shapes(cfg, with_mtp)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingTensorError(
            f"checkpoint {where}: missing {len(missing)} tensor(s) required by config.json "
            f"({cfg.family}, {cfg.num_layers} layers{', with its MTP layers' if with_mtp else ''}): "
            + ", ".join(repr(n) for n in missing[:8])
            + more
        )
    shapes = {n: tuple(peek(tensors, n).shape) for n in expected}
    bad = [(n, s, shapes[n]) for n, s in expected.items() if shapes[n] != s]
    if bad:
        raise TensorShapeError(
            f"checkpoint {where}: tensors disagree with config.json: "
            + "; ".join(f"{n!r}: expected {list(s)}, got {list(g)}" for n, s, g in bad[:8])
        )


def _layer(cfg: ModelConfig, tensors, prefix: str, sparse: bool, dtype, device) -> dict[str, jax.Array]:
    ds, nh = cfg.deepseek, cfg.num_heads

    def t(name):
        return jax.device_put(np.asarray(tensors[prefix + name]), device)

    def vec(name):
        return t(name).astype(dtype)

    def mat(name):  # [out, in] -> [in, out]
        return t(name).T.astype(dtype)

    lp = {"attn_norm": vec("input_layernorm.weight"), "mlp_norm": vec("post_attention_layernorm.weight")}
    if ds.q_lora_rank:
        lp["wq_a"] = mat("self_attn.q_a_proj.weight")
        lp["q_a_norm"] = vec("self_attn.q_a_layernorm.weight")
        lp["wq_b"] = mat("self_attn.q_b_proj.weight")
    else:
        lp["wq"] = mat("self_attn.q_proj.weight")
    lp["wkv_a"] = mat("self_attn.kv_a_proj_with_mqa.weight")
    lp["kv_a_norm"] = vec("self_attn.kv_a_layernorm.weight")
    kv_b = t("self_attn.kv_b_proj.weight").reshape(nh, ds.qk_nope_head_dim + ds.v_head_dim, ds.kv_lora_rank)
    lp["w_uk"] = kv_b[:, : ds.qk_nope_head_dim].astype(dtype)
    lp["w_uv"] = kv_b[:, ds.qk_nope_head_dim :].astype(dtype)
    lp["wo"] = mat("self_attn.o_proj.weight")
    if not sparse:
        lp["w_gate_up"] = jnp.concatenate([mat("mlp.gate_proj.weight"), mat("mlp.up_proj.weight")], axis=1)
        lp["w_down"] = mat("mlp.down_proj.weight")
        return lp
    # The router stays float32 whatever the dtype, as DeepSeek's and transformers' do.
    lp["router"] = t("mlp.gate.weight").T.astype(jnp.float32)
    if ds.topk_method == "noaux_tc":
        lp["router_bias"] = t("mlp.gate.e_score_correction_bias").astype(jnp.float32)
    E = cfg.num_experts
    lp["experts_gate_up"] = jnp.stack(
        [
            jnp.concatenate([mat(f"mlp.experts.{e}.gate_proj.weight"), mat(f"mlp.experts.{e}.up_proj.weight")], 1)
            for e in range(E)
        ]
    )
    lp["experts_down"] = jnp.stack([mat(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    if cfg.shared_expert_intermediate_size:
        lp["shared_gate_up"] = jnp.concatenate(
            [mat("mlp.shared_experts.gate_proj.weight"), mat("mlp.shared_experts.up_proj.weight")], axis=1
        )
        lp["shared_down"] = mat("mlp.shared_experts.down_proj.weight")
    return lp


def convert_deepseek_params(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any = jnp.float32,
    *,
    source: str | os.PathLike | None = None,
    device: jax.Device | None = None,
) -> dict[str, Any]:
    """The target's params: embed, per-layer dicts, final_norm, lm_head (the MTP layers are
    read by convert_mtp_params)."""
    where = repr(os.fspath(source)) if source is not None else "(in memory)"
    check_tensors(cfg, tensors, where)
    dtype = jnp.dtype(dtype)
    layers = [
        _layer(cfg, tensors, f"model.layers.{i}.", i in cfg.moe_layers, dtype, device) for i in range(cfg.num_layers)
    ]
    params = {
        "embed": jax.device_put(np.asarray(tensors["model.embed_tokens.weight"]), device).astype(dtype),
        "layers": layers,
        "final_norm": jax.device_put(np.asarray(tensors["model.norm.weight"]), device).astype(dtype),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jax.device_put(np.asarray(tensors["lm_head.weight"]), device).T.astype(dtype)
    return params


def convert_mtp_params(
    cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: Any = jnp.float32, *, source=None, device=None
) -> list[dict[str, jax.Array]]:
    """The checkpoint's MTP layers, one dict each: the decoder layer's weights (always a sparse
    layer) plus enorm, hnorm, eh_proj [2H, H] (input: [normed embedding | normed hidden]) and
    the shared head's norm. Their embed_tokens and shared_head.head are the target's own
    embedding and lm_head in published checkpoints, so the draft reads the target's."""
    where = repr(os.fspath(source)) if source is not None else "(in memory)"
    if not cfg.num_mtp_layers:
        raise CheckpointError(f"checkpoint {where} has no multi-token-prediction layers (num_nextn_predict_layers)")
    check_tensors(cfg, tensors, where, with_mtp=True)
    dtype = jnp.dtype(dtype)
    out = []
    for i in range(cfg.num_layers, cfg.num_layers + cfg.num_mtp_layers):
        p = f"model.layers.{i}."
        lp = _layer(cfg, tensors, p, True, dtype, device)
        for name in ("enorm", "hnorm"):
            lp[name] = jax.device_put(np.asarray(tensors[p + name + ".weight"]), device).astype(dtype)
        lp["eh_proj"] = jax.device_put(np.asarray(tensors[p + "eh_proj.weight"]), device).T.astype(dtype)
        lp["head_norm"] = jax.device_put(np.asarray(tensors[p + "shared_head.norm.weight"]), device).astype(dtype)
        out.append(lp)
    return out


def load_mtp_params(path: str | os.PathLike, cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    """The NEXTN draft's params from a checkpoint directory: {"mtp": the first MTP layer}, plus
    that layer's embed_tokens / shared_head.head as "embed" / "lm_head" where they differ from
    the target's (published checkpoints repeat the target's)."""
    tensors = read_hf_tensors(path)
    dtype = jnp.float32 if dtype is None else dtype
    mtp = convert_mtp_params(cfg, tensors, dtype, source=path)
    out: dict[str, Any] = {"mtp": mtp[0]}
    p = f"model.layers.{cfg.num_layers}."
    own_embed, own_head = tensors.get(p + "embed_tokens.weight"), tensors.get(p + "shared_head.head.weight")
    if own_embed is not None and not np.array_equal(own_embed, tensors["model.embed_tokens.weight"]):
        out["embed"] = jax.device_put(np.asarray(own_embed)).astype(dtype)
    target_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    if own_head is not None and not np.array_equal(own_head, target_head):
        out["lm_head"] = jax.device_put(np.asarray(own_head)).T.astype(dtype)
    return out


def layer_param_shapes(cfg: ModelConfig, sparse: bool) -> dict[str, tuple[int, ...]]:
    """One layer's leaf shapes in models/deepseek.py's layout."""
    ds, H, nh = cfg.deepseek, cfg.hidden_size, cfg.num_heads
    lp: dict[str, tuple[int, ...]] = {"attn_norm": (H,), "mlp_norm": (H,)}
    if ds.q_lora_rank:
        lp.update(wq_a=(H, ds.q_lora_rank), q_a_norm=(ds.q_lora_rank,), wq_b=(ds.q_lora_rank, nh * ds.qk_head_dim))
    else:
        lp["wq"] = (H, nh * ds.qk_head_dim)
    lp.update(
        wkv_a=(H, ds.latent_dim),
        kv_a_norm=(ds.kv_lora_rank,),
        w_uk=(nh, ds.qk_nope_head_dim, ds.kv_lora_rank),
        w_uv=(nh, ds.v_head_dim, ds.kv_lora_rank),
        wo=(nh * ds.v_head_dim, H),
    )
    if not sparse:
        lp.update(w_gate_up=(H, 2 * cfg.intermediate_size), w_down=(cfg.intermediate_size, H))
        return lp
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    lp.update(router=(H, E), experts_gate_up=(E, H, 2 * I), experts_down=(E, I, H))
    if ds.topk_method == "noaux_tc":
        lp["router_bias"] = (E,)
    if Is:
        lp.update(shared_gate_up=(H, 2 * Is), shared_down=(Is, H))
    return lp


def deepseek_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The target's pytree of leaf shapes (loader.param_shapes for a DeepSeek config)."""
    H = cfg.hidden_size
    shapes = {
        "embed": (cfg.vocab_size, H),
        "layers": [layer_param_shapes(cfg, i in cfg.moe_layers) for i in range(cfg.num_layers)],
        "final_norm": (H,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    return shapes


def mtp_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The NEXTN draft's pytree of leaf shapes: {"mtp": one sparse layer plus its fusion}."""
    H = cfg.hidden_size
    return {
        "mtp": {**layer_param_shapes(cfg, True), "enorm": (H,), "hnorm": (H,), "eh_proj": (2 * H, H), "head_norm": (H,)}
    }

"""The NEXTN draft's params from a checkpoint: its first multi-token-prediction layer.

DeepSeek-V3 keeps MTP layers at model.layers.{num_hidden_layers + i} (checkpoint/deepseek.py);
MiMo at model.mtp_layers.{i}: token_layernorm, hidden_layernorm, input_proj over
[hidden | embedding], a Qwen2 decoder layer, final_layernorm. Both come out as one dict laid
out as the target's layers plus enorm, hnorm, eh_proj ([embedding | hidden] -> H), head_norm.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.deepseek import load_mtp_params as load_deepseek
from jspec.checkpoint.errors import CheckpointError, MissingTensorError, TensorShapeError
from jspec.checkpoint.files import read_hf_tensors
from jspec.config.model import ModelConfig


def load_mtp_params(path: str | os.PathLike, cfg: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    """{"mtp": the first MTP layer's weights} (DeepSeek: plus its own embed / head where they
    differ from the target's)."""
    if cfg.deepseek is not None:
        return load_deepseek(path, cfg, dtype)
    return {"mtp": mimo_mtp_layer(cfg, read_hf_tensors(path), jnp.float32 if dtype is None else dtype, path)}


def mimo_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {
        "token_layernorm.weight": (H,),
        "hidden_layernorm.weight": (H,),
        "input_proj.weight": (H, 2 * H),
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
        "final_layernorm.weight": (H,),
    }
    if cfg.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    return shapes


def mimo_mtp_layer(cfg: ModelConfig, tensors, dtype, source=None) -> dict[str, jax.Array]:
    where = repr(os.fspath(source)) if source is not None else "(in memory)"
    if not cfg.num_mtp_layers:
        raise CheckpointError(f"checkpoint {where} has no multi-token-prediction layers (num_nextn_predict_layers)")
    if cfg.is_moe:
        raise CheckpointError(f"checkpoint {where}: MTP layers of MoE targets are supported for DeepSeek only")
    p = "model.mtp_layers.0."
    for name, shape in mimo_shapes(cfg).items():
        if p + name not in tensors:
            raise MissingTensorError(f"checkpoint {where}: missing MTP tensor {p + name!r}")
        if tuple(tensors[p + name].shape) != shape:
            raise TensorShapeError(
                f"checkpoint {where}: {p + name!r} is {list(tensors[p + name].shape)}, expected {list(shape)}"
            )

    def t(name):
        return jax.device_put(np.asarray(tensors[p + name]))

    def mat(*names):  # [out, in] each -> [in, sum(out)]
        return jnp.concatenate([t(n).T for n in names], axis=1).astype(dtype)

    H = cfg.hidden_size
    proj = t("input_proj.weight")  # [H, 2H] over [hidden | embedding]
    lp = {
        "enorm": t("token_layernorm.weight").astype(dtype),
        "hnorm": t("hidden_layernorm.weight").astype(dtype),
        "eh_proj": jnp.concatenate([proj[:, H:], proj[:, :H]], axis=1).T.astype(dtype),
        "attn_norm": t("input_layernorm.weight").astype(dtype),
        "wqkv": mat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "wo": mat("self_attn.o_proj.weight"),
        "mlp_norm": t("post_attention_layernorm.weight").astype(dtype),
        "w_gate_up": mat("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "w_down": mat("mlp.down_proj.weight"),
        "head_norm": t("final_layernorm.weight").astype(dtype),
    }
    if cfg.qkv_bias:
        lp["bqkv"] = jnp.concatenate(
            [t("self_attn.q_proj.bias"), t("self_attn.k_proj.bias"), t("self_attn.v_proj.bias")]
        ).astype(dtype)
    return lp

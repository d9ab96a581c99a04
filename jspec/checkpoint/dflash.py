"""DFlash drafter checkpoints: the published layout <-> DFlashConfig + the draft param pytree.

The layout is the reference implementation's (z-lab's `dflash` package, model.py:
DFlashDraftModel, a Qwen3PreTrainedModel saved with save_pretrained) and what SGLang reads:

    config.json: a Qwen3 config (hidden_size, intermediate_size, num_hidden_layers,
        num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope_theta /
        rope_scaling, layer_types, attention_bias) with architectures ["DFlashDraftModel"],
        block_size (top level, or in dflash_config), num_target_layers, and dflash_config:
        {"mask_token_id", "target_layer_ids"} (ids of target layers whose OUTPUT is read).
    model.safetensors: fc.weight [H, n*H], hidden_norm.weight, norm.weight, and per layer
        layers.{i}.input_layernorm / post_attention_layernorm .weight,
        layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
        layers.{i}.mlp.{gate,up,down}_proj.weight (nn.Linear's [out, in]). No embedding and
        no LM head: the drafter borrows the target's.

What the reference's later variants add is refused by name (DFlash2's convolutions and
candidate selector, sliding-window or causal draft layers, attention biases, own
vocabulary or embeddings, sinks); their scalar knobs input_embedding_scale, output_multiplier
and final_logit_softcapping are read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.eagle import default_draft_dtype, read_draft_config, read_draft_tensors
from jspec.checkpoint.errors import CheckpointError, MissingTensorError, TensorShapeError
from jspec.checkpoint.files import write_safetensors
from jspec.checkpoint.random_weights import random_weights
from jspec.config.dflash import DFlashConfig, default_target_layer_ids
from jspec.config.model import ModelConfig, UnsupportedArchitectureError

log = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"


class UnsupportedDFlashError(CheckpointError):
    """A DFlash variant or option jspec does not implement (named in the message)."""


def _field(hf: Mapping[str, Any], name: str, default=None):
    """The reference's lookup: dflash_config first, then the top level."""
    inner = hf.get("dflash_config") or {}
    return inner.get(name, hf.get(name, default))


def _refuse_variants(hf: Mapping[str, Any], where: str) -> None:
    archs = [str(a) for a in (hf.get("architectures") or [])]
    if archs and archs[0] != ARCHITECTURE:
        raise UnsupportedDFlashError(
            f"DFlash checkpoint {where}: architecture {archs[0]!r} is not implemented (jspec reads {ARCHITECTURE}; "
            f"DFlash2's convolutions and candidate selector, DSpark and other block drafters are not)"
        )
    refused = {
        "conv_kernel_size": "DFlash2's grouped dynamic convolutions",
        "conv_group_size": "DFlash2's grouped dynamic convolutions",
        "selector_rank": "DFlash2's candidate selector",
        "selector_top_k": "DFlash2's candidate selector",
        "projector_type": "another context projector",
        "attention_sink_bias": "attention sink biases",
        "attention_value_scale": "a value scale",
        "use_swa": "sliding-window draft attention",
        "is_causal": "causal draft attention",
        "causal": "causal draft attention",
        "has_embed_tokens": "the drafter's own embedding",
        "has_lm_head": "the drafter's own LM head",
        "draft_vocab_size": "a reduced draft vocabulary",
        "quantization_config": "a quantized drafter",
        "attention_bias": "attention biases",
    }
    for name, what in refused.items():
        value = _field(hf, name)
        if value not in (None, False, 0, "", {}):
            raise UnsupportedDFlashError(f"DFlash checkpoint {where}: {name}={value!r} ({what}) is not implemented")
    if _field(hf, "sample_from_anchor", True) is False:
        raise UnsupportedDFlashError(
            f"DFlash checkpoint {where}: sample_from_anchor=false (a block without the anchor row) is not implemented"
        )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedDFlashError(
            f"DFlash checkpoint {where}: layer_types {sorted(set(layer_types))} (sliding-window draft layers) "
            f"are not implemented"
        )


def dflash_config_from_hf(hf: Mapping[str, Any], target: ModelConfig, where: str = "(in memory)") -> DFlashConfig:
    """The drafter's config.json -> DFlashConfig for `target`; refuses by name what jspec does
    not implement and what does not fit the target."""
    _refuse_variants(hf, where)
    d = {k: v for k, v in hf.items() if k not in ("dflash_config", "layer_types")}
    d["architectures"] = ["Qwen3ForCausalLM"]
    d["vocab_size"] = target.vocab_size
    try:
        layers = ModelConfig.from_hf(d)
    except UnsupportedArchitectureError as e:
        raise UnsupportedDFlashError(f"{e} [DFlash checkpoint {where}]") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"DFlash config.json in {where} lacks or mistypes a field: {e}") from None
    if layers.sliding_windows:
        raise UnsupportedDFlashError(f"DFlash checkpoint {where}: sliding-window draft layers are not implemented")
    layers = dataclasses.replace(
        layers, max_position_embeddings=target.max_position_embeddings, eos_token_ids=(), bos_token_id=None
    )
    for name in ("hidden_size", "target_hidden_size"):
        if name in hf and int(hf[name]) != target.hidden_size:
            raise TensorShapeError(
                f"DFlash checkpoint {where}: config.json {name} is {hf[name]}, the target's hidden size is "
                f"{target.hidden_size} (the drafter reads the target's states and embeddings as they are)"
            )
    L = target.num_layers
    trained_for = _field(hf, "num_target_layers")
    if trained_for is not None and int(trained_for) != L:
        raise CheckpointError(
            f"DFlash checkpoint {where}: drafter of a {trained_for}-layer target (num_target_layers), this "
            f"target has {L} layers"
        )
    ids = _field(hf, "target_layer_ids")
    ids = default_target_layer_ids(L, layers.num_layers) if ids is None else tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i < L - 1]
    if bad:
        raise CheckpointError(
            f"DFlash checkpoint {where}: target_layer_ids {list(ids)} must name layers 0..{L - 2} of the "
            f"{L}-layer target (the last layer's output is read final-normed by the reference: not implemented)"
        )
    mask = _field(hf, "mask_token_id")
    if mask is None:
        raise UnsupportedDFlashError(
            f"DFlash checkpoint {where}: config.json names no dflash_config.mask_token_id (finding the mask "
            f"token by its text through the tokenizer is not implemented)"
        )
    softcap = _field(hf, "final_logit_softcapping")
    try:
        return DFlashConfig(
            layers=layers,
            block_size=int(_field(hf, "block_size", 16)),
            mask_token_id=int(mask),
            target_layer_ids=ids,
            input_embedding_scale=float(_field(hf, "input_embedding_scale", 1.0)),
            output_multiplier=float(_field(hf, "output_multiplier", 1.0)),
            final_logit_softcap=float(softcap) if softcap else None,
        )
    except ValueError as e:
        raise CheckpointError(f"DFlash checkpoint {where}: {e}") from None


# ---------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------

_LAYER_NAMES = {  # pytree leaf -> HF names, concatenated on the output axis
    "wqkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "wo": ("self_attn.o_proj.weight",),
    "w_gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_down": ("mlp.down_proj.weight",),
}
_LAYER_VECTORS = {
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}


def _hf_shapes(dcfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    c = dcfg.layers
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    shapes = {"fc.weight": (H, dcfg.feature_size), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (c.q_size, H),
                p + "self_attn.k_proj.weight": (c.kv_size, H),
                p + "self_attn.v_proj.weight": (c.kv_size, H),
                p + "self_attn.o_proj.weight": (H, c.q_size),
                p + "self_attn.q_norm.weight": (D,),
                p + "self_attn.k_norm.weight": (D,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
        )
    return shapes


def check_tensors(dcfg: DFlashConfig, tensors: Mapping[str, Any], where: str = "(in memory)") -> None:
    expected = _hf_shapes(dcfg)
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise MissingTensorError(
            f"DFlash checkpoint {where}: missing {len(missing)} tensor(s) of a {dcfg.layers.num_layers}-layer "
            f"drafter: {', '.join(repr(n) for n in missing[:8])}" + (" and more" if len(missing) > 8 else "")
        )
    bad = [(n, s, tuple(tensors[n].shape)) for n, s in expected.items() if tuple(tensors[n].shape) != s]
    if bad:
        raise TensorShapeError(
            f"DFlash checkpoint {where}: {len(bad)} tensor(s) disagree with config.json and the target (HF "
            f"layout, [out, in]): " + "; ".join(f"{n!r}: expected {list(s)}, got {list(g)}" for n, s, g in bad[:8])
        )
    unused = [n for n in tensors if n not in expected and not n.endswith("rotary_emb.inv_freq")]
    if any(n.endswith(".bias") for n in unused):  # ignoring a bias would silently change the math
        raise UnsupportedDFlashError(f"DFlash checkpoint {where}: bias tensors {unused[:8]} are not implemented")
    if unused:
        log.warning("DFlash checkpoint %s: ignoring %d unexpected tensor(s), e.g. %s", where, len(unused), unused[:4])


def convert_dflash_params(
    dcfg: DFlashConfig, tensors: Mapping[str, np.ndarray], dtype: Any = jnp.float32, where: str = "(in memory)"
) -> dict[str, Any]:
    """HF-named tensors -> the draft pytree (models/dflash.py), stacked on the host (drafters
    are small) and cast on the device."""
    check_tensors(dcfg, tensors, where)
    dtype = jnp.dtype(dtype)
    L = dcfg.layers.num_layers

    def put(a) -> jax.Array:
        return jnp.asarray(np.asarray(a, np.float32)).astype(dtype)

    layers = {}
    for leaf, parts in _LAYER_NAMES.items():
        layers[leaf] = put(
            np.stack([np.concatenate([np.asarray(tensors[f"layers.{i}.{p}"]).T for p in parts], 1) for i in range(L)])
        )
    for leaf, name in _LAYER_VECTORS.items():
        layers[leaf] = put(np.stack([np.asarray(tensors[f"layers.{i}.{name}"]) for i in range(L)]))
    return {
        "fc": put(np.asarray(tensors["fc.weight"]).T),
        "hidden_norm": put(tensors["hidden_norm.weight"]),
        "final_norm": put(tensors["norm.weight"]),
        "layers": layers,
    }


def dflash_tensors(dparams: Mapping[str, Any], dcfg: DFlashConfig) -> dict[str, np.ndarray]:
    """The draft pytree -> the published tensor names ([out, in], float32): the inverse of
    convert_dflash_params."""
    c = dcfg.layers
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    out = {
        "fc.weight": f32(np.asarray(dparams["fc"]).T),
        "hidden_norm.weight": f32(dparams["hidden_norm"]),
        "norm.weight": f32(dparams["final_norm"]),
    }
    widths = {"wqkv": (c.q_size, c.kv_size, c.kv_size), "w_gate_up": (c.intermediate_size,) * 2}
    for leaf, parts in _LAYER_NAMES.items():
        stacked = np.asarray(dparams["layers"][leaf], np.float32)
        for i in range(c.num_layers):
            cols = np.split(stacked[i], np.cumsum(widths[leaf])[:-1], axis=1) if leaf in widths else [stacked[i]]
            out.update({f"layers.{i}.{p}": f32(w.T) for p, w in zip(parts, cols)})
    for leaf, name in _LAYER_VECTORS.items():
        stacked = np.asarray(dparams["layers"][leaf], np.float32)
        out.update({f"layers.{i}.{name}": f32(stacked[i]) for i in range(c.num_layers)})
    return out


def dflash_param_shapes(dcfg: DFlashConfig) -> dict[str, Any]:
    c = dcfg.layers
    H, I, D, L = c.hidden_size, c.intermediate_size, c.head_dim, c.num_layers
    return {
        "fc": (dcfg.feature_size, H),
        "hidden_norm": (H,),
        "final_norm": (H,),
        "layers": {
            "attn_norm": (L, H),
            "wqkv": (L, H, c.q_size + 2 * c.kv_size),
            "q_norm": (L, D),
            "k_norm": (L, D),
            "wo": (L, c.q_size, H),
            "mlp_norm": (L, H),
            "w_gate_up": (L, H, 2 * I),
            "w_down": (L, I, H),
        },
    }


def init_random_dflash_params(
    dcfg: DFlashConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02
) -> dict[str, Any]:
    """Random params in the draft pytree (checkpoint/random_weights.py's rule: norms 1 + N(0, 0.1))."""
    return random_weights(dflash_param_shapes(dcfg), key, dtype, std)


# ---------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------


def dflash_config_for(
    target: ModelConfig,
    *,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
) -> DFlashConfig:
    """A drafter for `target` with the target's layer shapes and RoPE (what the reference's
    recipes build): num_layers Qwen3-style layers, the reference's default target layers."""
    layers = ModelConfig(
        family="qwen3",
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_layers=num_layers,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings,
        qk_norm=True,
    )
    # A shallow target's default can name a layer twice: one read of it is enough.
    ids = tuple(dict.fromkeys(target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)))
    mask = target.vocab_size - 1 if mask_token_id is None else mask_token_id
    return DFlashConfig(layers=layers, block_size=block_size, mask_token_id=mask, target_layer_ids=ids)


def dflash_hf_config(dcfg: DFlashConfig, target: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The published config.json of a drafter (what DFlashDraftModel.from_pretrained reads)."""
    c = dcfg.layers
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * c.num_layers,
        "num_target_layers": target.num_layers,
        "block_size": dcfg.block_size,
        "dflash_config": {"mask_token_id": dcfg.mask_token_id, "target_layer_ids": list(dcfg.target_layer_ids)},
        "torch_dtype": dtype,
    }
    if c.rope_scaling is not None:
        rs = dataclasses.asdict(c.rope_scaling)
        hf["rope_scaling"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in rs.items() if v != ()}
    for name, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        if getattr(dcfg, name) != default:
            hf["dflash_config"][name] = getattr(dcfg, name)
    if dcfg.final_logit_softcap is not None:
        hf["dflash_config"]["final_logit_softcapping"] = dcfg.final_logit_softcap
    return hf


def save_dflash(out_dir: str | os.PathLike, dcfg: DFlashConfig, dparams, target: ModelConfig) -> str:
    """Writes config.json + model.safetensors (float32) in the published layout; config.json last,
    so its presence means the directory is complete."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(out_dir, dflash_tensors(dparams, dcfg))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dflash_hf_config(dcfg, target), f, indent=2)
    return out_dir


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def load_dflash_model(
    path: str | os.PathLike, target: ModelConfig, dtype: Any = None
) -> tuple[DFlashConfig, dict[str, Any]]:
    """Loads a DFlash drafter for `target`. dtype None: bfloat16 on a GPU backend, float32 otherwise."""
    path = os.fspath(path)
    hf = read_draft_config(path, "DFlash drafter")
    dtype = default_draft_dtype() if dtype is None else dtype
    where = repr(path)
    dcfg = dflash_config_from_hf(hf, target, where)
    return dcfg, convert_dflash_params(dcfg, read_draft_tensors(path), dtype, where)

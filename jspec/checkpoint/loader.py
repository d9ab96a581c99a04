"""Checkpoint loading: HF `config.json` + safetensors -> jspec's param pytree.

Weights are [in, out], q/k/v and gate/up fused, layers stacked on a leading axis (a model
that mixes dense and MoE layers gets a list of per-layer dicts); the layout is the contract
with models/llama.py (docs/design-details.md, "The param pytree"). load_model also reads a
jspec-converted directory (jspec_config.json + an orbax checkpoint of the pytree).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.deepseek import convert_deepseek_params, deepseek_param_shapes
from jspec.checkpoint.errors import CheckpointError, MissingTensorError, TensorShapeError
from jspec.checkpoint.files import merge_shards, read_hf_shards
from jspec.checkpoint.fp8 import (
    Fp8Scheme,
    UnsupportedQuantizationError,
    fp8_scheme,
    is_fp8_tensor,
    known_extra_tensors,
    kv_scales,
    scale_columns,
)
from jspec.checkpoint.mxfp4 import check_mxfp4_family, dequantize_mxfp4, is_mxfp4
from jspec.checkpoint.progress import ReadProgress, TrackedTensors, peek
from jspec.checkpoint.random_weights import random_weights
from jspec.config.deepseek import DeepseekConfig
from jspec.config.errors import UnsupportedArchitectureError
from jspec.config.model import GEMMA_FAMILIES, ModelConfig, RopeScaling
from jspec.layers.quant import FP8, Fp8Weight
from jspec.models.common import unstack_layers

log = logging.getLogger(__name__)

JSPEC_CONFIG_FILE = "jspec_config.json"
PARAMS_SUBDIR = "params"
_FORMAT = "jspec-params"
_FORMAT_VERSION = 1
# Files copied by convert_checkpoint so a converted directory keeps its tokenizer.
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "config.json",
)


# ---------------------------------------------------------------------------
# safetensors reading
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# HF names -> stacked pytree
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _MoeLayout:
    """Where a checkpoint keeps a sparse layer's tensors (names relative to model.layers.{i}.)."""

    prefix: str = "mlp"  # "mlp", or Mixtral's "block_sparse_moe"
    fused: bool = False  # experts.gate_up_proj [E, 2I, H] + experts.down_proj [E, H, I]
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert: gate, up, down
    # gpt-oss: router.weight + router.bias; experts.gate_up_proj [E, H, 2I] (gate and up columns
    # interleaved) + experts.down_proj [E, I, H], each with a bias; mxfp4: both projections as
    # MXFP4 _blocks + _scales (checkpoint/mxfp4.py) instead.
    gpt_oss: bool = False
    mxfp4: bool = False

    @property
    def router(self) -> str:
        return f"{self.prefix}.router.weight" if self.gpt_oss else f"{self.prefix}.gate.weight"

    def expert(self, e: int, which: int) -> str:
        return f"{self.prefix}.experts.{e}.{self.names[which]}.weight"

    @property
    def fused_gate_up(self) -> str:
        return f"{self.prefix}.experts.gate_up_proj"

    @property
    def fused_down(self) -> str:
        return f"{self.prefix}.experts.down_proj"


_MIXTRAL_NAMES = ("w1", "w3", "w2")


def _moe_layout(cfg: ModelConfig, tensors: Mapping[str, Any]) -> _MoeLayout | None:
    """The checkpoint's MoE naming, read off its first sparse layer; for a checkpoint that has
    none of them, the family's classic names (so a missing-tensor error names those)."""
    if not cfg.is_moe:
        return None
    base = f"model.layers.{cfg.moe_layers[0]}."
    if cfg.family == "gpt_oss":
        return _MoeLayout(fused=True, gpt_oss=True, mxfp4=base + "mlp.experts.gate_up_proj_blocks" in tensors)
    for prefix in ("mlp", "block_sparse_moe"):
        if base + f"{prefix}.experts.gate_up_proj" in tensors:
            return _MoeLayout(prefix, fused=True)
        for names in (_MIXTRAL_NAMES, _MoeLayout.names):
            if base + f"{prefix}.experts.0.{names[0]}.weight" in tensors:
                return _MoeLayout(prefix, names=names)
    return _MoeLayout("block_sparse_moe", names=_MIXTRAL_NAMES) if cfg.family == "mixtral" else _MoeLayout()


def _moe_hf_shapes(cfg: ModelConfig, layout: _MoeLayout) -> dict[str, tuple[int, ...]]:
    """One sparse layer's HF tensors (relative names) and shapes."""
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    shapes = {layout.router: (E, H)}
    if layout.gpt_oss:
        shapes["mlp.router.bias"] = (E,)
        shapes["mlp.experts.gate_up_proj_bias"] = (E, 2 * I)
        shapes["mlp.experts.down_proj_bias"] = (E, H)
        if not layout.mxfp4:
            shapes.update({layout.fused_gate_up: (E, H, 2 * I), layout.fused_down: (E, I, H)})
            return shapes
        for name, out, inner in ((layout.fused_gate_up, 2 * I, H), (layout.fused_down, H, I)):
            shapes[name + "_blocks"] = (E, out, inner // 32, 16)
            shapes[name + "_scales"] = (E, out, inner // 32)
        return shapes
    if layout.fused:
        shapes[layout.fused_gate_up] = (E, 2 * I, H)
        shapes[layout.fused_down] = (E, H, I)
    else:
        for e in range(E):
            shapes[layout.expert(e, 0)] = (I, H)
            shapes[layout.expert(e, 1)] = (I, H)
            shapes[layout.expert(e, 2)] = (H, I)
    if cfg.shared_expert_intermediate_size:
        Is = cfg.shared_expert_intermediate_size
        shapes.update(
            {
                "mlp.shared_expert.gate_proj.weight": (Is, H),
                "mlp.shared_expert.up_proj.weight": (Is, H),
                "mlp.shared_expert.down_proj.weight": (H, Is),
                "mlp.shared_expert_gate.weight": (1, H),
            }
        )
    return shapes


# jspec's norm -> HF's name (relative to model.layers.{i}.), by norm layout. Llama's
# post_attention_layernorm is the norm before the MLP; Gemma 2/3's and OLMo 2's is the one on
# the attention's output.
_NORM_NAMES = {
    "pre": {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"},
    "sandwich": {
        "attn_norm": "input_layernorm.weight",
        "attn_post_norm": "post_attention_layernorm.weight",
        "mlp_norm": "pre_feedforward_layernorm.weight",
        "mlp_post_norm": "post_feedforward_layernorm.weight",
    },
    "post": {"attn_post_norm": "post_attention_layernorm.weight", "mlp_post_norm": "post_feedforward_layernorm.weight"},
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_FUSED_QKV = ("self_attn.qkv_proj.weight",)  # Phi-3: q, k, v stacked on the out axis
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_FUSED_GATE_UP = ("mlp.gate_up_proj.weight",)  # Phi-3: gate, up stacked on the out axis


def _fused_projections(tensors: Mapping[str, Any]) -> bool:
    """Whether the checkpoint stores q/k/v and gate/up fused (Phi-3)."""
    return "model.layers.0." + _FUSED_QKV[0] in tensors


def _hf_shapes(
    cfg: ModelConfig, moe_layout: _MoeLayout | None = None, fused: bool = False
) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config needs, with the shape HF stores it in ([out, in])."""
    H, I, V, D = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name in _NORM_NAMES[cfg.norm_layout].values():
            shapes[p + name] = (H,)
        if fused:
            shapes[p + _FUSED_QKV[0]] = (cfg.q_size + 2 * cfg.kv_size, H)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (cfg.q_size, H)
            shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_size, H)
            shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_size, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, cfg.q_size)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
        if cfg.qk_norm_whole:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.q_size,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.kv_size,)
        if cfg.attention_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_heads,)
        if i in cfg.moe_layers:
            shapes.update({p + n: s for n, s in _moe_hf_shapes(cfg, moe_layout or _MoeLayout()).items()})
            continue
        if fused:
            shapes[p + _FUSED_GATE_UP[0]] = (2 * I, H)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (I, H)
            shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
    return shapes


def _check_tensors(
    cfg: ModelConfig, tensors: Mapping[str, Any], where: str, moe_layout: _MoeLayout | None = None
) -> None:
    expected = _hf_shapes(cfg, moe_layout, _fused_projections(tensors))
    missing = [n for n in expected if n not in tensors]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingTensorError(
            f"checkpoint {where}: missing {len(missing)} tensor(s) required by config.json "
            f"({cfg.family}, {cfg.num_layers} layers): {shown}{more}"
        )
    shapes = {n: tuple(peek(tensors, n).shape) for n in expected}
    bad = [(n, s, shapes[n]) for n, s in expected.items() if shapes[n] != s]
    if bad:
        lines = "; ".join(f"{n!r}: expected {list(s)}, got {list(g)}" for n, s, g in bad[:8])
        more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
        raise TensorShapeError(
            f"checkpoint {where}: {len(bad)} tensor(s) disagree with config.json "
            f"(HF layout, nn.Linear weights are [out, in]): {lines}{more}"
        )
    # Old checkpoints carry rotary inv_freq buffers; anything else unexpected is
    # worth a warning, since the config checks should have rejected real variants.
    extra = known_extra_tensors(tensors)
    unused = [
        n
        for n in tensors
        if n not in expected
        and n not in extra
        and not n.endswith("rotary_emb.inv_freq")
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    ]
    if unused:
        log.warning("checkpoint %s: ignoring %d unexpected tensor(s), e.g. %s", where, len(unused), unused[:4])


def convert_hf_params(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any = jnp.float32,
    *,
    source: str | os.PathLike | None = None,
    device: jax.Device | None = None,
    fp8: Fp8Scheme | None = None,
    per_layer: bool = False,
) -> dict[str, jax.Array]:
    """Builds the jspec param pytree (jax arrays on `device`, default: the default
    device) from HF-named tensors. `source` names the checkpoint in errors.

    per_layer: params["layers"] as a list of per-layer dicts (the unrolled layer loop's
    layout), each array built in place: no stacked leaf is ever made, so none is freed later
    below the weights (a hole the KV pool's large leaves cannot use).

    Each weight matrix is sent to the device as it is stored ([out, in], source
    dtype, straight from the memory map) and cast, transposed and written into
    its slot of the preallocated stacked leaf there, in place (donated). So
    host memory holds one tensor at a time, device memory the params plus one
    tensor, and the transposes run on the device: numpy's strided bf16
    transpose and ml_dtypes' casts are slow on the host. (Transposing a whole
    stacked leaf at once instead made XLA's GPU autotuner take several times the leaf.)

    fp8 (checkpoint/fp8.py, from config.json's quantization_config): the projections stored
    in FP8 become Fp8Weight leaves (weights kept FP8, scales as [in_blocks, out] columns).
    """
    where = repr(os.fspath(source)) if source is not None else "(in memory)"
    moe_layout = _moe_layout(cfg, tensors)
    _check_tensors(cfg, tensors, where, moe_layout)
    leaves = _DeviceLeaves(cfg, tensors, np.dtype(jnp.dtype(dtype)), device, fp8, moe_layout, where, per_layer)
    fused = _fused_projections(tensors)
    # Gemma's RMSNorms scale by (1 + w): the offset is added here, once.
    norm_offset = 1.0 if cfg.family in GEMMA_FAMILIES else 0.0
    norms = {k: leaves.vectors([n], norm_offset) for k, n in _NORM_NAMES[cfg.norm_layout].items()}
    layers = {k: norms[k] for k in ("attn_norm",) if k in norms}
    layers.update(_attention_leaves(cfg, leaves, fused, norm_offset))
    layers.update({k: v for k, v in norms.items() if k != "attn_norm"})
    dense = {}
    if cfg.dense_layers:
        dense["w_gate_up"] = leaves.matrices(list(_FUSED_GATE_UP if fused else _GATE_UP), cfg.dense_layers)
        dense["w_down"] = leaves.matrices(["mlp.down_proj.weight"], cfg.dense_layers)
    sparse = _moe_leaves(cfg, leaves) if cfg.moe_layers else {}
    layers = assemble_layers(cfg, layers, dense, sparse, lambda a, j: a[j])
    if per_layer and isinstance(layers, dict):
        layers = [{k: v[i] for k, v in layers.items()} for i in range(cfg.num_layers)]
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        if n in tensors and is_fp8_tensor(tensors[n]):
            raise UnsupportedQuantizationError(
                f"checkpoint {where}: {n} in FP8 is not supported (only decoder projections)"
            )
    if cfg.is_moe and fp8 is not None:
        raise UnsupportedQuantizationError(f"checkpoint {where}: FP8 MoE checkpoints are not supported")

    final_norm = tensors["model.norm.weight"]
    if norm_offset:
        final_norm = np.asarray(final_norm, np.float32) + norm_offset
    params = {
        "embed": _cast(jax.device_put(tensors["model.embed_tokens.weight"], device), leaves.dtype),
        "layers": layers,
        "final_norm": _cast(jax.device_put(final_norm, device), leaves.dtype),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = leaves.lm_head(tensors["lm_head.weight"])
    kv = kv_scales(tensors, cfg.num_layers)
    if kv is not None:
        params["kv_scale"] = jax.device_put(kv, device)  # [L, 2]: what an FP8 KV cache divides K, V by
    return params


def _attention_leaves(cfg: ModelConfig, leaves: _DeviceLeaves, fused: bool, norm_offset: float) -> dict:
    """The attention's leaves of every layer: fused q/k/v, their biases and norms, o, sinks."""
    out = {"wqkv": leaves.matrices(list(_FUSED_QKV if fused else _QKV))}
    if cfg.qkv_bias:
        out["bqkv"] = leaves.vectors(["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"])
    if cfg.qk_norm or cfg.qk_norm_whole:
        out["q_norm"] = leaves.vectors(["self_attn.q_norm.weight"], norm_offset)
        out["k_norm"] = leaves.vectors(["self_attn.k_norm.weight"], norm_offset)
    out["wo"] = leaves.matrices(["self_attn.o_proj.weight"])
    if cfg.o_bias:
        out["bo"] = leaves.vectors(["self_attn.o_proj.bias"])
    if cfg.attention_sinks:
        out["sinks"] = leaves.vectors(["self_attn.sinks"])
    return out


def _moe_leaves(cfg: ModelConfig, leaves: _DeviceLeaves) -> dict:
    """The sparse layers' leaves: router, experts (gpt-oss's with biases), shared experts."""
    ids, lay = cfg.moe_layers, leaves.moe_layout
    sparse = {"router": leaves.matrices([lay.router], ids)}
    if lay.gpt_oss:
        sparse["router_bias"] = leaves.expert_vectors(ids, "mlp.router.bias")
        sparse["experts_gate_up"] = leaves.gpt_oss_experts(ids, lay.fused_gate_up, interleaved=True)
        sparse["experts_down"] = leaves.gpt_oss_experts(ids, lay.fused_down, interleaved=False)
        sparse["experts_b_gate_up"] = leaves.expert_vectors(ids, "mlp.experts.gate_up_proj_bias", interleaved=True)
        sparse["experts_b_down"] = leaves.expert_vectors(ids, "mlp.experts.down_proj_bias")
    else:
        sparse["experts_gate_up"] = leaves.experts(ids, lay.fused_gate_up, [0, 1])
        sparse["experts_down"] = leaves.experts(ids, lay.fused_down, [2])
    if cfg.shared_expert_intermediate_size:
        sparse["shared_gate_up"] = leaves.matrices(
            ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"], ids
        )
        sparse["shared_down"] = leaves.matrices(["mlp.shared_expert.down_proj.weight"], ids)
        sparse["shared_gate"] = leaves.matrices(["mlp.shared_expert_gate.weight"], ids)
    return sparse


@dataclasses.dataclass
class _DeviceLeaves:
    """Builds the pytree's leaves on the device from HF-named tensors, one tensor at a time
    (convert_hf_params says why): each stacked over its layers, or with per_layer a list of
    one array per layer."""

    cfg: ModelConfig
    tensors: Mapping[str, np.ndarray]
    dtype: np.dtype
    device: jax.Device | None
    fp8: Fp8Scheme | None
    moe_layout: _MoeLayout
    where: str  # the checkpoint, as errors name it
    per_layer: bool = False

    def _zeros(self, shape: tuple[int, ...], dtype) -> list[jax.Array] | jax.Array:
        """The leaf to fill, shape[0] being its layers: one array, or one per layer."""
        if self.per_layer:
            return [jnp.zeros(shape[1:], dtype, device=self.device) for _ in range(shape[0])]
        return jnp.zeros(shape, dtype, device=self.device)

    def _stacked(self, rows: np.ndarray) -> list[jax.Array] | jax.Array:
        """A host array over layers on the device, cast: whole, or a row per layer."""
        if self.per_layer:
            return [_cast(jax.device_put(r, self.device), self.dtype) for r in rows]
        return _cast(jax.device_put(rows, self.device), self.dtype)

    def vectors(self, parts: list[str], offset: float = 0.0) -> jax.Array | list[jax.Array]:
        """[L, sum(n)] (plus offset): tiny, so stacked on the host and sent at once."""
        rows = [
            np.concatenate([self.tensors[f"model.layers.{i}.{p}"] for p in parts]) for i in range(self.cfg.num_layers)
        ]
        stacked = np.stack(rows)
        if offset:
            stacked = stacked.astype(np.float32) + offset
        return self._stacked(stacked)

    def matrices(self, parts: list[str], layer_ids=None) -> jax.Array | Fp8Weight | list:
        """[len(layer_ids), in, sum(out)]: each layer's parts concatenated on the out axis
        (layer_ids: every layer when None)."""
        tensors, device = self.tensors, self.device
        layer_ids = tuple(range(self.cfg.num_layers)) if layer_ids is None else layer_ids
        first = [tensors[f"model.layers.{layer_ids[0]}.{p}"] for p in parts]
        names = [f"model.layers.{i}.{p}" for i in layer_ids for p in parts]
        quantized = [is_fp8_tensor(tensors[n]) for n in names]
        if any(quantized) and not all(quantized):
            raise UnsupportedQuantizationError(
                f"checkpoint {self.where}: {parts} are FP8 in some layers only; jspec stacks a projection's "
                f"layers, so they must all be FP8 or all unquantized"
            )
        if all(quantized) and self.fp8 is None:
            raise UnsupportedQuantizationError(f"checkpoint {self.where}: FP8 tensors but no quantization_config")
        leaf_dtype = FP8 if all(quantized) else self.dtype
        out = self._zeros((len(layer_ids), first[0].shape[1], sum(t.shape[0] for t in first)), leaf_dtype)
        for j, i in enumerate(layer_ids):
            col = 0
            for p in parts:
                t = tensors[f"model.layers.{i}.{p}"]
                out = _fill(out, j, jax.device_put(t, device), (0, col), transposed=True)
                col += t.shape[0]
        if not all(quantized):
            return out
        # Host side: a scale is [in_blocks, out] f32, 1/128 of the weight's bytes or less.
        scales = np.stack(
            [
                np.concatenate(
                    [scale_columns(self.fp8, tensors, f"model.layers.{i}.{p.removesuffix('.weight')}") for p in parts],
                    axis=1,
                )
                for i in layer_ids
            ]
        )
        if self.per_layer:
            return [Fp8Weight(w, jax.device_put(s, device)) for w, s in zip(out, scales)]
        return Fp8Weight(out, jax.device_put(scales, device))

    def experts(self, layer_ids, fused: str, per_expert: list[int]) -> jax.Array | list[jax.Array]:
        """[n, E, in, sum(out)] from the fused [E, out, in] tensor or per-expert [out, in] ones."""
        tensors, device = self.tensors, self.device
        E, lay = self.cfg.num_experts, self.moe_layout
        pieces = (
            [tensors[f"model.layers.{layer_ids[0]}.{lay.expert(0, w)}"] for w in per_expert]
            if not lay.fused
            else [tensors[f"model.layers.{layer_ids[0]}.{fused}"][0]]
        )
        shape = (len(layer_ids), E, pieces[0].shape[1], sum(t.shape[0] for t in pieces))
        out = self._zeros(shape, self.dtype)
        for j, i in enumerate(layer_ids):
            if lay.fused:
                fused_t = jax.device_put(tensors[f"model.layers.{i}.{fused}"], device)
                out = _fill(out, j, fused_t, (0, 0, 0), transposed=True)
                continue
            for e in range(E):
                col = 0
                for w in per_expert:
                    t = tensors[f"model.layers.{i}.{lay.expert(e, w)}"]
                    out = _fill(out, j, jax.device_put(t, device), (e, 0, col), transposed=True)
                    col += t.shape[0]
        return out

    def gpt_oss_experts(self, layer_ids, name: str, interleaved: bool) -> jax.Array | list[jax.Array]:
        """[n, E, in, out] of gpt-oss's [E, in, out] experts, one expert at a time (dequantised
        from MXFP4 on the host: a layer's experts in f32 would be gigabytes); interleaved gate /
        up columns become gate columns, then up columns."""

        def expert(i, e):
            key = f"model.layers.{i}.{name}"
            if self.moe_layout.mxfp4:
                w = dequantize_mxfp4(self.tensors[key + "_blocks"][e], self.tensors[key + "_scales"][e])
            else:
                w = np.asarray(self.tensors[key][e])
            return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1) if interleaved else w

        E = self.cfg.num_experts
        first = expert(layer_ids[0], 0)
        out = self._zeros((len(layer_ids), E, *first.shape), self.dtype)
        for j, i in enumerate(layer_ids):
            for e in range(E):
                piece = jax.device_put(first if j == e == 0 else expert(i, e), self.device)
                out = _fill(out, j, piece, (e, 0, 0), transposed=False)
        return out

    def expert_vectors(self, layer_ids, name: str, interleaved: bool = False) -> jax.Array | list[jax.Array]:
        """[n, *shape] of a small per-layer tensor (biases), gate / up columns as gpt_oss_experts'."""
        rows = [np.asarray(self.tensors[f"model.layers.{i}.{name}"]) for i in layer_ids]
        if interleaved:
            rows = [np.concatenate([r[..., 0::2], r[..., 1::2]], axis=-1) for r in rows]
        return self._stacked(np.stack(rows))

    def lm_head(self, t: np.ndarray) -> jax.Array:
        """[V, H] -> [H, V], in row blocks of at most 256 MiB."""
        out = jnp.zeros(t.shape[::-1], self.dtype, device=self.device)
        block = max(1, (256 << 20) // max(1, t.shape[1] * t.dtype.itemsize))
        for r in range(0, t.shape[0], block):
            out = _place_transposed(out, jax.device_put(t[r : r + block], self.device), (0, r))
        return out


def _fill(out, j: int, piece: jax.Array, offsets: tuple[int, ...], *, transposed: bool):
    """Layer j's slot of a leaf (one stacked array, or a list of per-layer ones) at offsets
    within the layer = piece, in place; transposed: piece's last two axes swapped first."""
    place = _place_transposed if transposed else _place
    if isinstance(out, list):
        out[j] = place(out[j], piece, offsets)
        return out
    return place(out, piece, (j, *offsets))


def _cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x if x.dtype == dtype else _astype(x, dtype)


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(0,))
def _astype(x: jax.Array, dtype: np.dtype) -> jax.Array:
    return x.astype(dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def _place(out: jax.Array, piece: jax.Array, offsets: tuple[int, ...]) -> jax.Array:
    """out[offsets...] = piece (cast), in place, as _place_transposed without the transpose."""
    piece = piece.astype(out.dtype)
    return jax.lax.dynamic_update_slice(out, piece.reshape((1,) * (out.ndim - piece.ndim) + piece.shape), offsets)


@functools.partial(jax.jit, donate_argnums=(0,))
def _place_transposed(out: jax.Array, piece: jax.Array, offsets: tuple[int, ...]) -> jax.Array:
    """out[offsets...] = piece with its last two axes swapped (cast), in place: `out` is
    donated and offsets are traced, so one program per piece shape serves every layer."""
    piece = jnp.swapaxes(piece.astype(out.dtype), -1, -2)
    piece = piece.reshape((1,) * (out.ndim - piece.ndim) + piece.shape)
    return jax.lax.dynamic_update_slice(out, piece, offsets)


def assemble_layers(cfg: ModelConfig, common: dict, dense: dict, sparse: dict, take) -> dict | list[dict]:
    """params["layers"] from leaves stacked over all layers (common), over cfg.dense_layers
    (dense MLP) and over cfg.moe_layers (sparse): one stacked dict when the layers are alike,
    else a list of per-layer dicts, take(leaf, j) being row j of a stacked leaf."""
    if not sparse or not dense:
        return {**common, **dense, **sparse}
    per_layer = []
    for i in range(cfg.num_layers):
        own, j = (sparse, cfg.moe_layers.index(i)) if i in cfg.moe_layers else (dense, cfg.dense_layers.index(i))
        per_layer.append({**{k: take(v, i) for k, v in common.items()}, **{k: take(v, j) for k, v in own.items()}})
    return per_layer


def param_shapes(cfg: ModelConfig, per_layer: bool = False) -> dict[str, Any]:
    """The pytree's leaf shapes for a config (same structure as the params); per_layer: the
    layers as a list of per-layer dicts (convert_hf_params' per_layer layout)."""
    shapes = _stacked_param_shapes(cfg)
    if per_layer and isinstance(shapes["layers"], dict):
        stacked = shapes["layers"]
        shapes["layers"] = [{k: s[1:] for k, s in stacked.items()} for _ in range(cfg.num_layers)]
    return shapes


def _stacked_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.deepseek is not None:
        return deepseek_param_shapes(cfg)
    H, I, D, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    qkv = cfg.q_size + 2 * cfg.kv_size
    norms = {k: (L, H) for k in _NORM_NAMES[cfg.norm_layout]}
    layers = {k: norms[k] for k in ("attn_norm",) if k in norms}
    layers["wqkv"] = (L, H, qkv)
    if cfg.qkv_bias:
        layers["bqkv"] = (L, qkv)
    if cfg.qk_norm:
        layers["q_norm"] = (L, D)
        layers["k_norm"] = (L, D)
    if cfg.qk_norm_whole:
        layers["q_norm"] = (L, cfg.q_size)
        layers["k_norm"] = (L, cfg.kv_size)
    layers["wo"] = (L, cfg.q_size, H)
    if cfg.o_bias:
        layers["bo"] = (L, H)
    if cfg.attention_sinks:
        layers["sinks"] = (L, cfg.num_heads)
    layers.update({k: v for k, v in norms.items() if k != "attn_norm"})
    nd, ns = len(cfg.dense_layers), len(cfg.moe_layers)
    dense = dict(w_gate_up=(nd, H, 2 * I), w_down=(nd, I, H)) if nd else {}
    sparse = {}
    if ns:
        E, Im, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        sparse = dict(router=(ns, H, E), experts_gate_up=(ns, E, H, 2 * Im), experts_down=(ns, E, Im, H))
        if cfg.moe_biases:
            sparse.update(router_bias=(ns, E), experts_b_gate_up=(ns, E, 2 * Im), experts_b_down=(ns, E, H))
        if Is:
            sparse.update(shared_gate_up=(ns, H, 2 * Is), shared_down=(ns, Is, H), shared_gate=(ns, H, 1))
    layers = assemble_layers(cfg, layers, dense, sparse, lambda shape, j: shape[1:])
    shapes = {"embed": (cfg.vocab_size, H), "layers": layers, "final_norm": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    return shapes


def count_params(params: Any) -> int:
    return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))


# ---------------------------------------------------------------------------
# Random params (benchmarks, tests without a checkpoint)
# ---------------------------------------------------------------------------


def init_random_params(
    cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32, std: float = 0.02, per_layer: bool = False
) -> dict[str, Any]:
    """Random params in the loader's pytree (checkpoint/random_weights.py's rule); per_layer:
    drawn as per-layer arrays (param_shapes' per_layer), no stacked leaf made."""
    return random_weights(param_shapes(cfg, per_layer), key, dtype, std)


# ---------------------------------------------------------------------------
# Converted (orbax) checkpoints
# ---------------------------------------------------------------------------


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return {"format": _FORMAT, "version": _FORMAT_VERSION, "model_config": dataclasses.asdict(cfg)}


def config_from_json(data: Mapping[str, Any]) -> ModelConfig:
    if data.get("format") != _FORMAT:
        raise CheckpointError(f"{JSPEC_CONFIG_FILE} has format {data.get('format')!r}, expected {_FORMAT!r}")
    d = dict(data["model_config"])
    for key in ("rope_scaling", "sliding_rope_scaling"):
        if d.get(key) is not None:
            d[key] = RopeScaling(**d[key])
    if d.get("deepseek") is not None:
        d["deepseek"] = DeepseekConfig(**d["deepseek"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    d["moe_layers"] = tuple(d.get("moe_layers") or ())
    return ModelConfig(**d)


def _checkpointer():
    import orbax.checkpoint as ocp  # imported lazily: it is slow and only needed here

    return ocp.StandardCheckpointer()


def save_params(params: Any, directory: str | os.PathLike, *, config: ModelConfig | None = None) -> str:
    """Writes the pytree to `directory/params` with orbax (exact, any dtype incl. bf16)
    and, when `config` is given, `directory/jspec_config.json`, which makes the
    directory loadable by `load_model`. Overwrites an existing checkpoint there."""
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    with _checkpointer() as ckptr:
        ckptr.save(os.path.join(directory, PARAMS_SUBDIR), params, force=True)
    if config is not None:
        with open(os.path.join(directory, JSPEC_CONFIG_FILE), "w") as f:
            json.dump(config_to_json(config), f, indent=2)
    return directory


def restore_params(
    directory: str | os.PathLike, like: Any = None, *, dtype: Any = None, device: jax.Device | None = None
) -> dict[str, Any]:
    """Reads a pytree written by `save_params`.

    `like` (a pytree of arrays or jax.ShapeDtypeStruct, with shardings) chooses
    placement and dtype. Without it every leaf goes to `device` (default: the default
    device) with its saved dtype (or `dtype`); the saved sharding is not reused, so a
    checkpoint written on a GPU restores on the CPU and vice versa.
    """
    directory = os.path.abspath(os.fspath(directory))
    path = os.path.join(directory, PARAMS_SUBDIR)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no orbax params checkpoint at {path!r} (written by save_params)")
    with _checkpointer() as ckptr:
        if like is None:
            meta = ckptr.metadata(path)
            tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
            placement = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
            like = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(
                    tuple(m.shape), jnp.dtype(dtype) if dtype is not None else m.dtype, sharding=placement
                ),
                tree,
            )
        elif dtype is not None or device is not None:
            raise ValueError("pass either like= or dtype= / device=, not both")
        return ckptr.restore(path, like)


def is_converted_dir(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, JSPEC_CONFIG_FILE))


def _default_dtype():
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def load_model(
    path: str | os.PathLike, dtype: Any = None, progress_name: str | None = None, per_layer: bool = False
) -> tuple[ModelConfig, dict[str, Any]]:
    """Loads an HF checkpoint directory or a jspec converted directory.

    dtype None: bfloat16 on a GPU backend, float32 otherwise. Returns jax arrays
    on the default device. progress_name: a checkpoint of several shards reports its
    reading under this name (checkpoint/progress.py). per_layer: the Llama family's layers
    as per-layer arrays on the device (an HF checkpoint's built so by convert_hf_params, a
    jspec converted directory's restored stacked on the host and put on the device a layer at
    a time), with no stacked device array to free; DeepSeek's are per layer anyway.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"model path {path!r} is a file; pass the checkpoint directory")
    dtype = _default_dtype() if dtype is None else dtype
    if is_converted_dir(path):
        with open(os.path.join(path, JSPEC_CONFIG_FILE)) as f:
            cfg = config_from_json(json.load(f))
        params = restore_params(path, dtype=dtype, device=jax.devices("cpu")[0] if per_layer else None)
        _check_converted(cfg, params, path)
        return cfg, (_layers_to_device(params) if per_layer else params)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"no config.json in model directory {path!r} (expected an HF checkpoint: config.json + "
            f"model.safetensors, or a jspec directory with {JSPEC_CONFIG_FILE})"
        )
    try:
        cfg = ModelConfig.from_pretrained(path)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{e} [model directory {path!r}]") from None
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"config.json in {path!r} lacks or mistypes a required field: {e}") from None
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    if is_mxfp4(hf_config):  # the experts' blocks are dequantised in convert_hf_params
        check_mxfp4_family(cfg.family)
        scheme = None
    else:
        scheme = fp8_scheme(hf_config)
    if cfg.deepseek is not None and scheme is not None:
        raise UnsupportedQuantizationError(
            f"{cfg.family}: FP8 checkpoints of latent-attention (MLA) models are not supported yet [{path!r}]"
        )
    shards = read_hf_shards(path)
    tensors = merge_shards(shards, path)
    progress = None
    if progress_name is not None and len(shards) > 1:
        progress = ReadProgress(shards, progress_name)
        tensors = TrackedTensors(tensors, progress)
    try:
        if cfg.deepseek is not None:
            params = convert_deepseek_params(cfg, tensors, dtype, source=path)
        else:
            params = convert_hf_params(cfg, tensors, dtype, source=path, fp8=scheme, per_layer=per_layer)
    finally:
        if progress is not None:
            progress.close()
    return cfg, params


def _layers_to_device(params: dict[str, Any]) -> dict[str, Any]:
    """params restored on the host, on the default device with the layers as per-layer dicts
    (param_shapes' per_layer layout): each layer's arrays go there alone, no stack does."""
    return jax.device_put(unstack_layers(params), jax.devices()[0])


def _check_converted(cfg: ModelConfig, params: Any, path: str) -> None:
    expected = param_shapes(cfg)
    got = jax.tree.map(lambda x: tuple(x.shape), params)
    if got != expected:
        raise TensorShapeError(
            f"converted checkpoint {path!r}: params {got} disagree with {JSPEC_CONFIG_FILE} ({expected})"
        )


def convert_checkpoint(hf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: Any = None) -> str:
    """HF directory -> jspec converted directory (params + config + tokenizer files)."""
    cfg, params = load_model(hf_path, dtype)
    if any(isinstance(x, Fp8Weight) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Fp8Weight))):
        raise UnsupportedQuantizationError("converting an FP8 checkpoint to jspec's orbax format is not implemented")
    save_params(params, out_dir, config=cfg)
    for name in _SIDE_FILES:
        src = os.path.join(hf_path, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
    return os.path.abspath(os.fspath(out_dir))

"""FP8 checkpoints: config.json's quantization_config, and each projection's scales as jspec holds
them (layers/quant.py: [in_blocks, out] f32, the output axis last).

Layouts read:
- quant_method "fp8" (HF transformers / SGLang / DeepSeek): weight_scale per tensor, or with
  weight_block_size DeepSeek's block scales weight_scale_inv [ceil(out/bo), ceil(in/bi)];
- quant_method "compressed-tensors", format float-quantized: weight_scale per tensor [1],
  per channel [out, 1] or per block [ceil(out/bo), ceil(in/bi)].
Activations are not quantized (weight-only FP8); static input_scale tensors are accepted and
checked, and KV scales (self_attn.k_scale / v_scale) are read for an FP8 KV cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jspec.checkpoint.errors import CheckpointError, TensorShapeError

FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn),)
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale")
KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale")


class UnsupportedQuantizationError(CheckpointError):
    pass


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint stores its FP8 projections."""

    scale_name: str  # "weight_scale" or "weight_scale_inv"
    block: tuple[int, int] | None  # (out rows, in columns) per scale, or None: per tensor / channel
    static_activations: bool  # input_scale tensors present (checked, not used)


def fp8_scheme(hf_config: Mapping[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of config.json's quantization_config; None for an unquantized checkpoint.
    Anything else (other methods, other bit widths) is refused by name."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        act = qc.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise UnsupportedQuantizationError(f"fp8 activation_scheme {act!r} is not supported")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedQuantizationError(f"fp8 fmt {qc['fmt']!r} is not supported; jspec reads e4m3")
        if block is not None:
            return Fp8Scheme("weight_scale_inv", _block(block), act == "static")
        return Fp8Scheme("weight_scale", None, act == "static")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    raise UnsupportedQuantizationError(
        f"quantization_config quant_method {method!r} is not supported; jspec reads 'fp8' and "
        f"'compressed-tensors' (float-quantized FP8)"
    )


def _block(block) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) < 1 for b in block):
        raise UnsupportedQuantizationError(f"weight_block_size {block!r} is not two positive sizes")
    return int(block[0]), int(block[1])


def _compressed_tensors_scheme(qc: Mapping[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise UnsupportedQuantizationError(
            f"compressed-tensors format {fmt!r} is not supported; jspec reads 'float-quantized' (FP8)"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise UnsupportedQuantizationError(
            f"compressed-tensors with {len(groups)} config_groups is not supported; jspec reads one group"
        )
    weights = groups[0].get("weights") or {}
    if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
        raise UnsupportedQuantizationError(f"compressed-tensors weights {weights} are not FP8 (type float, 8 bits)")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise UnsupportedQuantizationError("compressed-tensors FP8 weights must be symmetric and static")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise UnsupportedQuantizationError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    block = _block(weights["block_structure"]) if strategy == "block" else None
    acts = groups[0].get("input_activations") or {}
    return Fp8Scheme("weight_scale", block, bool(acts) and not acts.get("dynamic", True))


def is_fp8_tensor(t: np.ndarray) -> bool:
    return t.dtype in FP8_DTYPES


def scale_columns(scheme: Fp8Scheme, tensors: Mapping[str, np.ndarray], module: str) -> np.ndarray:
    """module's (e.g. "model.layers.0.self_attn.q_proj") scales as [in_blocks, out] f32."""
    w = tensors[module + ".weight"]
    out, inp = w.shape
    name = f"{module}.{scheme.scale_name}"
    if name not in tensors:
        raise TensorShapeError(f"FP8 weight {module}.weight has no {scheme.scale_name}")
    s = np.asarray(tensors[name], np.float32)
    if scheme.static_activations:
        a = tensors.get(module + ".input_scale")
        if a is None or a.size != 1 or not np.all(np.isfinite(np.asarray(a, np.float32))):
            raise TensorShapeError(f"{module}: static activation scheme needs a scalar input_scale")
    if scheme.block is None:
        if s.size == 1:
            cols = np.full((1, out), s.reshape(()), np.float32)
        elif s.shape in ((out, 1), (out,)):
            cols = s.reshape(1, out)
        else:
            raise TensorShapeError(f"{name}: shape {list(s.shape)} is neither per tensor nor per channel [{out}, 1]")
    else:
        bo, bi = scheme.block
        want = (-(-out // bo), -(-inp // bi))
        if s.shape != want:
            raise TensorShapeError(f"{name}: shape {list(s.shape)}, expected {list(want)} for blocks {[bo, bi]}")
        if inp % bi:
            raise UnsupportedQuantizationError(
                f"{module}: input size {inp} is not a multiple of the scale block {bi} (ragged blocks not supported)"
            )
        cols = np.repeat(s.T, bo, axis=1)[:, :out]
    if not np.all(np.isfinite(cols)):
        raise TensorShapeError(f"{name}: scales are not finite")
    return np.ascontiguousarray(cols)


def known_extra_tensors(tensors: Mapping[str, np.ndarray]) -> set[str]:
    """Scale tensors an FP8 checkpoint carries beside the weights (not unexpected)."""
    return {n for n in tensors if n.rsplit(".", 1)[-1] in SCALE_SUFFIXES or n.endswith(KV_SCALE_NAMES)}


def kv_scales(tensors: Mapping[str, np.ndarray], num_layers: int) -> np.ndarray | None:
    """[L, 2] f32 (k_scale, v_scale) per layer when the checkpoint has them, else None."""
    names = [[f"model.layers.{i}.{n}" for n in KV_SCALE_NAMES] for i in range(num_layers)]
    present = [n in tensors for row in names for n in row]
    if not any(present):
        return None
    if not all(present):
        raise TensorShapeError("the checkpoint has self_attn.k_scale / v_scale for some layers only")
    out = np.array([[float(np.asarray(tensors[n], np.float32).reshape(())) for n in row] for row in names], np.float32)
    if not np.all(np.isfinite(out) & (out > 0)):
        raise TensorShapeError("self_attn.k_scale / v_scale must be positive and finite")
    return out

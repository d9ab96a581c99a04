"""FP8 checkpoints for tests, quantized from an unquantized HF directory, in the layouts people
publish (tensor names and quantization_config as transformers, SGLang and compressed-tensors
write them), and the dequantised twin an HF reference runs on.

Written with numpy and ml_dtypes only: nothing of jspec's own FP8 reading is used, so a test
that compares the two checks the reader.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np

from jspec.checkpoint.files import read_hf_tensors, write_safetensors

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# name -> (quantization_config without the block size, weight scale granularity, static input scales)
LAYOUTS = {
    "fp8_tensor_static": ("fp8", "tensor", True),  # AutoFP8 / SGLang: weight_scale [], input_scale []
    "fp8_block": ("fp8", "block", False),  # DeepSeek-V3: weight_scale_inv per block, dynamic activations
    "ct_channel_dynamic": ("compressed-tensors", "channel", False),  # llm-compressor FP8_DYNAMIC
    "ct_tensor_static": ("compressed-tensors", "tensor", True),  # llm-compressor FP8 (static)
    "ct_block": ("compressed-tensors", "block", False),  # llm-compressor FP8_BLOCK
}


def _quantize(w: np.ndarray, granularity: str, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] f32 -> (e4m3 [out, in], scale) with w ~= q * scale (broadcast per granularity)."""
    w = w.astype(np.float32)
    if granularity == "tensor":
        scale = np.float32(max(np.abs(w).max(), 1e-12) / E4M3_MAX)
        return np.clip(w / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3), np.array(scale, np.float32)
    if granularity == "channel":
        scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-12) / E4M3_MAX
        return np.clip(w / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3), scale.astype(np.float32)
    bo, bi = block
    out, inp = w.shape
    nbo, nbi = -(-out // bo), -(-inp // bi)
    padded = np.zeros((nbo * bo, nbi * bi), np.float32)
    padded[:out, :inp] = w
    tiles = padded.reshape(nbo, bo, nbi, bi)
    scale = np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-12) / E4M3_MAX  # [nbo, nbi]
    q = np.clip(tiles / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).reshape(padded.shape)[:out, :inp]
    return q.astype(E4M3), scale.astype(np.float32)


def _dequantize(q: np.ndarray, scale: np.ndarray, granularity: str, block: tuple[int, int]) -> np.ndarray:
    w = q.astype(np.float32)
    if granularity in ("tensor", "channel"):
        return w * scale.reshape(-1, 1) if scale.size > 1 else w * scale.reshape(())
    bo, bi = block
    full = np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: w.shape[0], : w.shape[1]]
    return w * full


def _quantization_config(method: str, granularity: str, static: bool, block: tuple[int, int]) -> dict:
    if method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
        if granularity == "block":
            qc["weight_block_size"] = list(block)
        return qc
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": granularity}
    if granularity == "block":
        weights["block_structure"] = list(block)
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static}
    acts["strategy"] = "tensor" if static else ("group" if granularity == "block" else "token")
    if granularity == "block":
        acts["group_size"] = block[1]
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
    }


def write_fp8_checkpoint(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    layout: str,
    *,
    block: tuple[int, int] = (128, 128),
    dequantized_dir: str | os.PathLike | None = None,
    kv_scales: tuple[float, float] | None = None,
) -> str:
    """Quantizes src's decoder projections to e4m3 in `layout` (a LAYOUTS name) into out_dir;
    with dequantized_dir, also writes the unquantized checkpoint of the same (dequantised)
    weights there, in f32. kv_scales: (k_scale, v_scale) written for every layer."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown FP8 layout {layout!r}; choose one of {sorted(LAYOUTS)}")
    method, granularity, static = LAYOUTS[layout]
    tensors = {n: np.asarray(a, np.float32) for n, a in read_hf_tensors(src).items()}
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.startswith("model.layers.") and name.endswith(".weight") and module.endswith(PROJECTIONS)):
            quantized[name] = dequantized[name] = t
            continue
        q, scale = _quantize(t, granularity, block)
        quantized[name] = q
        dequantized[name] = _dequantize(q, scale, granularity, block)
        if method == "fp8":
            quantized[module + (".weight_scale_inv" if granularity == "block" else ".weight_scale")] = scale
        else:
            quantized[module + ".weight_scale"] = scale.reshape(1) if granularity == "tensor" else scale
        if static:
            # The calibrated input scale: |x| / 448 of some activation range; checked, not used.
            quantized[module + ".input_scale"] = np.array(0.02, np.float32).reshape(() if method == "fp8" else (1,))
    if kv_scales is not None:
        for i in range(config["num_hidden_layers"]):
            quantized[f"model.layers.{i}.self_attn.k_scale"] = np.array(kv_scales[0], np.float32)
            quantized[f"model.layers.{i}.self_attn.v_scale"] = np.array(kv_scales[1], np.float32)
    _write(
        src,
        out_dir,
        quantized,
        {**config, "quantization_config": _quantization_config(method, granularity, static, block)},
    )
    if dequantized_dir is not None:
        _write(src, dequantized_dir, dequantized, {**config, "torch_dtype": "float32"})
    return os.fspath(out_dir)


def _write(src, out_dir, tensors: dict, config: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.fspath(out_dir), tensors)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

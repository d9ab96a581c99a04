"""Tiny random EAGLE / EAGLE-3 draft heads in the published on-disk layouts.

For a given target ModelConfig, `make_tiny_draft(out_dir, target, "EAGLE")`
writes what SafeAILab / SGLang heads look like (see checkpoint/eagle.py for
the layouts): config.json with the head's LlamaConfig fields and
model.safetensors with un-prefixed names (fc.*, layers.0.* or midlayer.*,
norm, lm_head, d2t/t2d). Weights are N(0, 1/fan_in) and norm scales
1 + N(0, 0.1), as in checkpoint/tiny.py, so a misplaced norm or transpose shows.

A pytorch_model.bin variant needs torch, which jspec does not depend on:
tests write one from `tiny_draft_tensors(...)` through the HF venv.
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np

from jspec.checkpoint.eagle_config import draft_hf_config, write_draft_config
from jspec.checkpoint.files import write_safetensors
from jspec.checkpoint.tiny import draw_hf_tensors
from jspec.config.model import ModelConfig


def tiny_draft_tensors(
    target: ModelConfig, hf_config: dict[str, Any], seed: int = 0, *, with_embed: bool = False, with_t2d: bool = True
) -> dict[str, np.ndarray]:
    """Random float32 tensors with the published names for `hf_config`
    (d2t int64, t2d bool, as in the EAGLE-3 releases)."""
    rng = np.random.default_rng(seed)
    eagle3 = "draft_vocab_size" in hf_config
    H, I, V = target.hidden_size, hf_config["intermediate_size"], target.vocab_size
    D = hf_config["head_dim"]
    q, kv = hf_config["num_attention_heads"] * D, hf_config["num_key_value_heads"] * D
    attn_in = 2 * H if eagle3 else H

    def linear(out_f: int, in_f: int) -> tuple[int, int]:  # nn.Linear layout [out, in]
        return (out_f, in_f)

    def norm(n: int) -> tuple[int]:
        return (n,)

    def layer(p: str) -> dict[str, np.ndarray]:
        return {
            p + "self_attn.q_proj.weight": linear(q, attn_in),
            p + "self_attn.k_proj.weight": linear(kv, attn_in),
            p + "self_attn.v_proj.weight": linear(kv, attn_in),
            p + "self_attn.o_proj.weight": linear(H, q),
            p + "post_attention_layernorm.weight": norm(H),
            p + "mlp.gate_proj.weight": linear(I, H),
            p + "mlp.up_proj.weight": linear(I, H),
            p + "mlp.down_proj.weight": linear(H, I),
        }

    t: dict = {}  # names -> shapes, drawn at the end; d2t / t2d are ids, not weights
    ids: dict[str, np.ndarray] = {}
    if eagle3:
        n_capture = len(hf_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        t["fc.weight"] = linear(H, n_capture * H)
        t.update(layer("midlayer."))
        t["midlayer.input_layernorm.weight"] = norm(H)
        t["midlayer.hidden_norm.weight"] = norm(H)
        t["norm.weight"] = norm(H)
        Vd = hf_config["draft_vocab_size"]
        t["lm_head.weight"] = linear(Vd, H)
        hot = np.sort(rng.choice(V, Vd, replace=False)) if Vd < V else np.arange(V)
        ids["d2t"] = (hot - np.arange(Vd)).astype(np.int64)
        if with_t2d:
            t2d = np.zeros(V, bool)
            t2d[hot] = True
            ids["t2d"] = t2d
    else:
        t["fc.weight"] = linear(H, 2 * H)
        for i in range(hf_config["num_hidden_layers"]):
            t.update(layer(f"layers.{i}."))
            if i > 0:  # SafeAILab builds input_layernorm only for layers after the first
                t[f"layers.{i}.input_layernorm.weight"] = norm(H)
    if hf_config.get("bias"):
        t["fc.bias"] = (H,)
    if with_embed:
        t["embed_tokens.weight"] = (V, H)
    return {**draw_hf_tensors(t, seed), **ids}


def cast_floats(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """float32 -> `dtype` ("float32" | "bfloat16" | "float16") for float tensors only."""
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    return {n: a.astype(np_dtype) if a.dtype == np.float32 else a for n, a in tensors.items()}


def make_tiny_draft(
    out_dir: str | os.PathLike,
    target: ModelConfig,
    algorithm: str = "EAGLE",
    seed: int = 0,
    *,
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    capture_layers: tuple[int, ...] | None = None,
    fc_bias: bool | None = None,
    with_embed: bool = False,
    dtype: str = "float32",
    num_shards: int = 1,
) -> str:
    """Writes a random draft head for `target` (safetensors) and returns its directory."""
    hf = draft_hf_config(
        target,
        algorithm,
        num_layers=num_layers,
        draft_vocab_size=draft_vocab_size,
        capture_layers=capture_layers,
        fc_bias=fc_bias,
        dtype=dtype,
    )
    tensors = cast_floats(tiny_draft_tensors(target, hf, seed, with_embed=with_embed), dtype)
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(out_dir, tensors, num_shards)
    return write_draft_config(out_dir, hf)  # last, so its presence means the directory is complete

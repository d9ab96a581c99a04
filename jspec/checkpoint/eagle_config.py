"""An EAGLE / EAGLE-3 head's config.json as SafeAILab and SGLang write it: what the trainer
saves beside a head it trained, and what the tiny test heads carry (checkpoint/eagle.py reads
it back)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jspec.config.model import ModelConfig


def tiny_capture_layers(num_target_layers: int) -> tuple[int, ...]:
    """Three distinct layers (entering-layer convention) for small targets,
    where SGLang's default [2, L//2, L-3] collides or goes negative."""
    L = num_target_layers
    if L >= 7:
        return (2, L // 2, L - 3)
    if L >= 4:
        return (1, L // 2, L - 1)
    return (0, L // 2, L)


def draft_hf_config(
    target: ModelConfig,
    algorithm: str = "EAGLE",
    *,
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    capture_layers: tuple[int, ...] | None = None,
    fc_bias: bool | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The head's config.json. EAGLE3 capture layers are written the SGLang way,
    as eagle_config.eagle_aux_hidden_state_layer_ids = entering layer - 1."""
    if algorithm not in ("EAGLE", "EAGLE3"):
        raise ValueError(f"algorithm must be 'EAGLE' or 'EAGLE3', got {algorithm!r}")
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle" if algorithm == "EAGLE" else "LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        # SafeAILab's EAGLE fc has a bias by default; SGLang's EAGLE3 fc has none unless config "bias".
        "bias": (algorithm == "EAGLE") if fc_bias is None else bool(fc_bias),
        "torch_dtype": dtype,
    }
    if target.rope_scaling is not None:
        cfg["rope_scaling"] = dataclasses.asdict(target.rope_scaling)
    if algorithm == "EAGLE3":
        if num_layers != 1:
            raise ValueError("EAGLE3 heads have one layer")
        capture = capture_layers if capture_layers is not None else tiny_capture_layers(target.num_layers)
        cfg["draft_vocab_size"] = draft_vocab_size if draft_vocab_size is not None else max(1, target.vocab_size // 4)
        cfg["target_hidden_size"] = target.hidden_size
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in capture],
            "use_aux_hidden_state": True,
        }
    return cfg


def write_draft_config(out_dir: str | os.PathLike, hf_config: dict[str, Any]) -> str:
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    return out_dir

"""PEFT LoRA adapters read from disk and checked against the base model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jspec.checkpoint.errors import CheckpointError
from jspec.checkpoint.files import read_safetensors_file
from jspec.checkpoint.hub import resolve_checkpoint
from jspec.config.model import ModelConfig

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

# fused projection -> its modules, in the fused weight's column order (models/llama.py).
FUSED_PROJECTIONS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "o": ("o_proj",),
    "down": ("down_proj",),
}

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoraError(CheckpointError):
    """An adapter that cannot be used with this engine (names the file and the problem)."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each supported projection, as HF's Linear(in, out)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (H, cfg.q_size),
        "k_proj": (H, cfg.kv_size),
        "v_proj": (H, cfg.kv_size),
        "o_proj": (cfg.q_size, H),
        "gate_proj": (H, I),
        "up_proj": (H, I),
        "down_proj": (I, H),
    }


@dataclasses.dataclass
class LoraAdapter:
    """One adapter on the host, in jspec's layout: per module A [L, in, r], B [L, r, out]
    (float32; layers the adapter leaves out are zeros)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    uid: int = 0  # set when loaded: unique per load (a reload under the same name is a new adapter)


def _config(path: str) -> dict:
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise LoraError(
            f"LoRA adapter {path!r}: no adapter_config.json (a PEFT adapter directory has "
            f"adapter_config.json and adapter_model.safetensors)"
        )
    with open(cfg_file) as f:
        return json.load(f)


def adapter_dir(path: str | os.PathLike) -> str:
    """The adapter's directory: `path` itself, or a Hub repo's snapshot when it is a repo id."""
    return resolve_checkpoint(path, "adapter")


def read_rank(path: str | os.PathLike) -> int:
    """An adapter's rank r, from its adapter_config.json alone (path: a directory or a Hub repo id)."""
    return int(_config(adapter_dir(path))["r"])


def load_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads and checks a PEFT LoRA adapter (a directory or a Hub repo id) against the base
    model's config."""
    path = adapter_dir(path)
    ac = _config(path)
    where = f"LoRA adapter {name!r} ({path})"
    if ac.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: peft_type {ac.get('peft_type')!r} is not LORA")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False)):
        if ac.get(key, off):
            raise LoraError(f"{where}: {key}=true is not supported")
    if ac.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias={ac['bias']!r} is not supported (only 'none')")
    if ac.get("modules_to_save"):
        raise LoraError(
            f"{where}: modules_to_save {ac['modules_to_save']} (fully trained extra modules) is not supported"
        )
    if ac.get("rank_pattern") or ac.get("alpha_pattern"):
        raise LoraError(f"{where}: per-module rank_pattern / alpha_pattern is not supported")
    r, alpha = int(ac["r"]), float(ac.get("lora_alpha", 8))  # PEFT's default alpha is 8
    if not 1 <= r <= max_rank:
        raise LoraError(
            f"{where}: rank r={r} exceeds this engine's max_lora_rank={max_rank} "
            f"(start the engine with max_lora_rank >= {r})"
        )
    targets = ac.get("target_modules") or []
    if targets == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        targets = list(SUPPORTED_MODULES)
    elif isinstance(targets, str):
        # A regex over full module paths (PEFT's re.fullmatch): the tensors present say which
        # modules it chose; each is still checked against what jspec supports.
        pattern = re.compile(targets)
        targets = [
            m
            for m in SUPPORTED_MODULES
            if any(
                pattern.fullmatch(f"model.layers.{i}.{kind}.{m}")
                for i in range(cfg.num_layers)
                for kind in ("self_attn", "mlp")
            )
        ]
        if not targets:
            raise LoraError(
                f"{where}: target_modules regex {pattern.pattern!r} matches none of the projections "
                f"jspec supports ({list(SUPPORTED_MODULES)})"
            )
    bad = sorted(set(targets) - set(SUPPORTED_MODULES))
    if bad:
        raise LoraError(
            f"{where}: target modules {bad} are not supported; jspec applies LoRA to {list(SUPPORTED_MODULES)}"
        )
    scaling = alpha / math.sqrt(r) if ac.get("use_rslora", False) else alpha / r

    files = [os.path.join(path, "adapter_model.safetensors")]
    if not os.path.isfile(files[0]):
        raise LoraError(f"{where}: no adapter_model.safetensors")
    tensors = read_safetensors_file(files[0])
    shapes = module_shapes(cfg)
    L = cfg.num_layers
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    seen: set[tuple[str, int, str]] = set()
    for key, t in tensors.items():
        m = _TENSOR_NAME.match(key)
        if m is None:
            raise LoraError(f"{where}: tensor {key!r} is not a LoRA A/B matrix of a decoder layer projection")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        if module not in SUPPORTED_MODULES:
            raise LoraError(
                f"{where}: tensor {key!r} targets module {module!r}; jspec applies LoRA to {list(SUPPORTED_MODULES)}"
            )
        if module not in targets:
            raise LoraError(
                f"{where}: tensor {key!r} is for {module!r}, which adapter_config.json's "
                f"target_modules {targets} does not list"
            )
        if not 0 <= layer < L:
            raise LoraError(f"{where}: tensor {key!r} is for layer {layer}; the base model has {L} layers")
        if layer in cfg.moe_layers and module in MLP_MODULES:
            raise LoraError(
                f"{where}: tensor {key!r} is for the MLP of layer {layer}, a mixture-of-experts "
                f"layer; on MoE layers jspec applies LoRA to the attention projections only"
            )
        fan_in, fan_out = shapes[module]
        want = (r, fan_in) if ab == "A" else (fan_out, r)
        if tuple(t.shape) != want:
            raise LoraError(
                f"{where}: tensor {key!r} has shape {list(t.shape)}, expected {list(want)} (rank {r}, "
                f"{module} of the base model is {fan_in} -> {fan_out})"
            )
        if module not in weights:
            weights[module] = (np.zeros((L, fan_in, r), np.float32), np.zeros((L, r, fan_out), np.float32))
        # PEFT's A [r, in] and B [out, r] -> jspec's x @ A [in, r] @ B [r, out].
        weights[module][0 if ab == "A" else 1][layer] = np.asarray(t, np.float32).T
        seen.add((module, layer, ab))
    for module, layer, ab in seen:
        if (module, layer, "B" if ab == "A" else "A") not in seen:
            raise LoraError(f"{where}: layer {layer} {module} has lora_{ab} but not its pair")
    if not weights:
        raise LoraError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return LoraAdapter(name, path, r, scaling, weights)

"""Multi-LoRA: PEFT adapters read from disk, and a device-side pool of resident adapters.

An adapter (PEFT's adapter_config.json + adapter_model.safetensors) adds to a projection
W [in, out] (jspec's layout, x @ W) the low-rank term scale * (x @ A^T) @ B^T, where PEFT
stores lora_A [r, in] and lora_B [out, r]. Several adapters are resident at once in a
`LoraPool`; each token of a batch names the pool slot of its request's adapter (slot 0 is
"no adapter"), and the forward adds every token's own delta (models/llama.py).

Pool layout, per group of modules whose A (or B) matrices share a shape:
    a[group] [L, G, S, in, r_max]      b[group] [L, G, S, r_max, out]
(L layers, G modules in the group, S = max_loras: slot s > 0 is stored at index s - 1, and
slot 0 takes no storage and no compute, its mask column being implicit; ranks are
zero-padded to r_max). Layers lead so
each layer's slice is contiguous (the unrolled forward takes it without a copy, a scan
takes it as xs); grouping keeps the step's argument count small (dispatch cost grows with
leaves) and lets q/k/v (and gate/up) share one A matmul, whose deltas come out
concatenated in the fused wqkv (w_gate_up) column order.

The forward computes every slot's delta for every token and masks it to the token's own
slot: dense matmuls with S * r_max columns and no per-token weight gather, so its cost
does not depend on how many distinct adapters a batch mixes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.models.loader import CheckpointError, read_safetensors_file

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# module -> (A group, index in it, B group, index in it). A groups by input width, B groups
# by output width; q/k/v and gate/up sit side by side in "a_hidden" so each set is one matmul.
_PLACE = {
    "q_proj": ("a_hidden", 0, "b_q", 0),
    "k_proj": ("a_hidden", 1, "b_kv", 0),
    "v_proj": ("a_hidden", 2, "b_kv", 1),
    "gate_proj": ("a_hidden", 3, "b_gate_up", 0),
    "up_proj": ("a_hidden", 4, "b_gate_up", 1),
    "o_proj": ("a_o", 0, "b_hidden", 0),
    "down_proj": ("a_down", 0, "b_hidden", 1),
}
_A_GROUPS = {"a_hidden": 5, "a_o": 1, "a_down": 1}
_B_GROUPS = {"b_q": 1, "b_kv": 2, "b_gate_up": 2, "b_hidden": 2}

_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoraError(CheckpointError):
    """An adapter that cannot be used with this engine (names the file and the problem)."""


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each supported projection, as HF's Linear(in, out)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (H, cfg.q_size), "k_proj": (H, cfg.kv_size), "v_proj": (H, cfg.kv_size),
            "o_proj": (cfg.q_size, H), "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}


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
        raise LoraError(f"LoRA adapter {path!r}: no adapter_config.json (a PEFT adapter directory has "
                        f"adapter_config.json and adapter_model.safetensors)")
    with open(cfg_file) as f:
        return json.load(f)


def read_rank(path: str | os.PathLike) -> int:
    """An adapter's rank r, from its adapter_config.json alone."""
    return int(_config(os.fspath(path))["r"])


def load_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Reads and checks a PEFT LoRA adapter against the base model's config."""
    path = os.fspath(path)
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
        raise LoraError(f"{where}: modules_to_save {ac['modules_to_save']} (fully trained extra modules) is not "
                        f"supported")
    if ac.get("rank_pattern") or ac.get("alpha_pattern"):
        raise LoraError(f"{where}: per-module rank_pattern / alpha_pattern is not supported")
    r, alpha = int(ac["r"]), float(ac.get("lora_alpha", 8))  # PEFT's default alpha is 8
    if not 1 <= r <= max_rank:
        raise LoraError(f"{where}: rank r={r} exceeds this engine's max_lora_rank={max_rank} "
                        f"(start the engine with max_lora_rank >= {r})")
    targets = ac.get("target_modules") or []
    if targets == "all-linear":  # PEFT's shorthand: every linear layer but the output head
        targets = list(SUPPORTED_MODULES)
    elif isinstance(targets, str):
        # A regex over full module paths (PEFT's re.fullmatch): the tensors present say which
        # modules it chose; each is still checked against what jspec supports.
        pattern = re.compile(targets)
        targets = [m for m in SUPPORTED_MODULES
                   if any(pattern.fullmatch(f"model.layers.{i}.{kind}.{m}")
                          for i in range(cfg.num_layers) for kind in ("self_attn", "mlp"))]
        if not targets:
            raise LoraError(f"{where}: target_modules regex {pattern.pattern!r} matches none of the projections "
                            f"jspec supports ({list(SUPPORTED_MODULES)})")
    bad = sorted(set(targets) - set(SUPPORTED_MODULES))
    if bad:
        raise LoraError(f"{where}: target modules {bad} are not supported; jspec applies LoRA to "
                        f"{list(SUPPORTED_MODULES)}")
    if cfg.is_moe:
        raise LoraError(f"{where}: LoRA on mixture-of-experts models is not supported yet")
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
            raise LoraError(f"{where}: tensor {key!r} targets module {module!r}; jspec applies LoRA to "
                            f"{list(SUPPORTED_MODULES)}")
        if module not in targets:
            raise LoraError(f"{where}: tensor {key!r} is for {module!r}, which adapter_config.json's "
                            f"target_modules {targets} does not list")
        if not 0 <= layer < L:
            raise LoraError(f"{where}: tensor {key!r} is for layer {layer}; the base model has {L} layers")
        fan_in, fan_out = shapes[module]
        want = (r, fan_in) if ab == "A" else (fan_out, r)
        if tuple(t.shape) != want:
            raise LoraError(f"{where}: tensor {key!r} has shape {list(t.shape)}, expected {list(want)} (rank {r}, "
                            f"{module} of the base model is {fan_in} -> {fan_out})")
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


class LoraWeights(NamedTuple):
    """The pool on the device (a step argument): see the module docstring for the layout."""

    a: dict  # group -> [L, G, S, in, r_max]
    b: dict  # group -> [L, G, S, r_max, out]
    scale: jax.Array  # [S] float32, scale of slot index + 1 (0 where empty)


class LoraBatch(NamedTuple):
    """What a forward needs for LoRA: the pool and each token's slot."""

    weights: LoraWeights
    token_slots: jax.Array  # [T] int32, 0 = no adapter


def layer_weights(weights: LoraWeights, i) -> LoraWeights:
    """Layer i's slice of the pool (the scale is shared by all layers)."""
    return LoraWeights({k: v[i] for k, v in weights.a.items()}, {k: v[i] for k, v in weights.b.items()}, weights.scale)


def slot_mask(weights: LoraWeights, token_slots: jax.Array) -> jax.Array:
    """[T, S] float32: each token's scale on its own slot, zero elsewhere (all zero for slot 0)."""
    S = weights.scale.shape[0]
    return (token_slots[:, None] == jnp.arange(1, S + 1, dtype=jnp.int32)[None]) * weights.scale[None]


def lora_delta(lw: LoraWeights, mask: jax.Array, h: jax.Array, a_group: str, a_range: tuple[int, int],
               b_group: str, b_range: tuple[int, int]) -> jax.Array:
    """Sum over modules a_range of group a_group (paired with b_range of b_group) of each
    token's own low-rank delta, concatenated on the output axis in module order:
    f32 [T, sum of outs]. lw is one layer's slice."""
    a = lw.a[a_group][a_range[0] : a_range[1]]  # [G, S, in, r]
    b = lw.b[b_group][b_range[0] : b_range[1]]  # [G, S, r, out]
    u = jnp.einsum("ti,gsir->tgsr", h, a.astype(h.dtype), preferred_element_type=jnp.float32)
    u = (u * mask[:, None, :, None]).astype(h.dtype)
    d = jnp.einsum("tgsr,gsro->tgo", u, b.astype(h.dtype), preferred_element_type=jnp.float32)
    return d.reshape(h.shape[0], -1)


def qkv_delta(lw, mask, h):
    return jnp.concatenate([lora_delta(lw, mask, h, "a_hidden", (0, 1), "b_q", (0, 1)),
                            lora_delta(lw, mask, h, "a_hidden", (1, 3), "b_kv", (0, 2))], axis=-1)


def gate_up_delta(lw, mask, h):
    return lora_delta(lw, mask, h, "a_hidden", (3, 5), "b_gate_up", (0, 2))


def o_delta(lw, mask, h):
    return lora_delta(lw, mask, h, "a_o", (0, 1), "b_hidden", (0, 1))


def down_delta(lw, mask, h):
    return lora_delta(lw, mask, h, "a_down", (0, 1), "b_hidden", (1, 2))


def _write(arr, val, g, s):
    return arr.at[:, g, s].set(val.astype(arr.dtype))


# Donated, so a load does not hold two copies of the pool.
_write_donated = jax.jit(_write, donate_argnums=0)


class LoraPool:
    """Resident adapters: the device arrays and the host registry name -> slot.

    max_loras adapters fit at once (slots 1..max_loras; slot 0 is no adapter). Loading writes
    an adapter's matrices into a free slot without touching the compiled steps (the pool's
    shapes never change); unloading frees the slot for the next load.
    """

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype, mesh=None):
        if mesh is not None:
            raise ValueError("LoRA with tensor parallelism (tp_size > 1) is not supported yet: the pool is not "
                             "laid out for the blocked per-shard projections; use tp_size=1")
        if cfg.is_moe:
            raise ValueError("LoRA on mixture-of-experts models is not supported yet")
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_lora_rank ({max_rank}) must be >= 1")
        self.cfg, self.max_loras, self.max_rank = cfg, max_loras, max_rank
        L, S, r = cfg.num_layers, max_loras, max_rank
        shapes = module_shapes(cfg)
        a_in = {g: shapes[next(m for m, p in _PLACE.items() if p[0] == g)][0] for g in _A_GROUPS}
        b_out = {g: shapes[next(m for m, p in _PLACE.items() if p[2] == g)][1] for g in _B_GROUPS}
        self.weights = LoraWeights(
            {g: jnp.zeros((L, n, S, a_in[g], r), dtype) for g, n in _A_GROUPS.items()},
            {g: jnp.zeros((L, n, S, r, b_out[g]), dtype) for g, n in _B_GROUPS.items()},
            jnp.zeros(S, jnp.float32),
        )
        self.slots: dict[str, int] = {}  # adapter name -> slot
        self.num_loads = 0  # gives each load its uid
        self.adapters: dict[str, LoraAdapter] = {}

    def load(self, adapter: LoraAdapter) -> int:
        if adapter.name in self.slots:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded (unload it first)")
        if adapter.rank > self.max_rank:
            raise LoraError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} exceeds max_lora_rank="
                            f"{self.max_rank}")
        free = [s for s in range(1, self.max_loras + 1) if s not in self.slots.values()]
        if not free:
            raise ValueError(f"all {self.max_loras} LoRA slots are in use ({sorted(self.slots)}); unload one or "
                             f"raise max_loras")
        slot = free[0]
        r = adapter.rank
        a, b = dict(self.weights.a), dict(self.weights.b)
        # Every module of the slot is written (zeros where the adapter has none), so nothing of
        # the slot's previous adapter survives.
        for module, (ag, ai, bg, bi) in _PLACE.items():
            A = np.zeros(a[ag].shape[:1] + a[ag].shape[3:], np.float32)  # [L, in, r_max]
            B = np.zeros(b[bg].shape[:1] + b[bg].shape[3:], np.float32)  # [L, r_max, out]
            if module in adapter.weights:
                A[:, :, :r], B[:, :r, :] = adapter.weights[module]
            a[ag] = _write_donated(a[ag], jnp.asarray(A), ai, slot - 1)
            b[bg] = _write_donated(b[bg], jnp.asarray(B), bi, slot - 1)
        scale = self.weights.scale.at[slot - 1].set(adapter.scaling)
        self.weights = LoraWeights(a, b, scale)
        self.num_loads += 1
        adapter.uid = self.num_loads
        self.slots[adapter.name] = slot
        self.adapters[adapter.name] = adapter
        return slot

    def unload(self, name: str) -> None:
        if name not in self.slots:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.slots)})")
        slot = self.slots.pop(name)
        del self.adapters[name]
        # Zero its scale: a token that still names the slot (none should) gets no delta.
        self.weights = self.weights._replace(scale=self.weights.scale.at[slot - 1].set(0.0))

    def slot_of(self, name: str | None) -> int:
        if name is None:
            return 0
        if name not in self.slots:
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.slots)}")
        return self.slots[name]

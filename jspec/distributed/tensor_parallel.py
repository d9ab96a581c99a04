"""Tensor parallelism (and expert parallelism of MoE layers) on a jax.sharding Mesh.

Megatron's split as shardings GSPMD follows: QKV and gate-up column-parallel, O and down
row-parallel, the KV pool over KV heads, embedding and LM head over the vocabulary; attention
runs per shard under shard_map. The fused weights get a shard axis ([H, tp, n / tp]) so a
shard's q, k, v (gate, up) sit together, and KV heads fewer than the shards are repeated, as
SGLang does. Experts split whole over the same devices (EP = TP).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jspec.config.model import ModelConfig
from jspec.distributed.mesh import TENSOR


def make_mesh(tp_size: int, devices=None) -> Mesh:
    """A one-axis mesh ("tensor") over the first tp_size devices."""
    devices = list(jax.devices() if devices is None else devices)
    if tp_size < 1 or tp_size > len(devices):
        raise ValueError(
            f"tp_size={tp_size} needs that many devices; this process sees {len(devices)} "
            f"(on the CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)"
        )
    return Mesh(np.asarray(devices[:tp_size]), (TENSOR,), axis_types=(AxisType.Auto,))


def tp_size_of(mesh: Mesh | None) -> int:
    return 1 if mesh is None or TENSOR not in mesh.axis_names else mesh.shape[TENSOR]


def check_tp_config(cfg: ModelConfig, tp: int) -> None:
    if tp > 1 and cfg.attention_sinks:
        raise ValueError(f"--tp-size {tp}: tensor parallelism over attention sinks (gpt-oss) is not implemented")
    problems = []
    if cfg.is_moe and cfg.num_experts % tp:
        problems.append(f"num_experts ({cfg.num_experts}; experts are split over the TP devices)")
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads ({cfg.num_heads})")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads ({cfg.num_kv_heads}; or tp a multiple of it)")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    if problems:
        raise ValueError(f"--tp-size {tp} must divide " + ", ".join(problems))


def kv_head_repeat(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is held over tp shards: tp / Hkv with fewer KV heads than
    shards (every shard then holds one), else 1."""
    return tp // cfg.num_kv_heads if cfg.num_kv_heads < tp else 1


def repeat_kv_columns(cfg: ModelConfig, w, r: int):
    """[..., Q + 2 KV] (a fused qkv weight's columns) -> [..., Q + 2 r KV], each K/V head's
    columns repeated r times in place."""
    D, Q, KV = cfg.head_dim, cfg.q_size, cfg.kv_size
    q, k, v = w[..., :Q], w[..., Q : Q + KV], w[..., Q + KV :]
    rep = (
        lambda a: jax.numpy.repeat(a.reshape(*a.shape[:-1], cfg.num_kv_heads, D), r, axis=-2).reshape(  # noqa: E731
            *a.shape[:-1], r * KV
        )
    )
    return jax.numpy.concatenate([q, rep(k), rep(v)], axis=-1)


def replicate_kv_heads(cfg: ModelConfig, params, tp: int):
    """With fewer KV heads than shards, repeats each KV head tp / Hkv times (so every shard
    holds one); the query heads of a group then read copies of their own K and V."""
    r = kv_head_repeat(cfg, tp)
    if r == 1:
        return cfg, params
    # jax.tree.map: an FP8 weight's scale has its output axis last too, and widens alike.
    widen = lambda w: jax.tree.map(lambda a: repeat_kv_columns(cfg, a, r), w)  # noqa: E731

    def layer(lp):
        lp = dict(lp)
        lp["wqkv"] = widen(lp["wqkv"])
        if "bqkv" in lp:
            lp["bqkv"] = widen(lp["bqkv"])
        return lp

    layers = params["layers"]
    layers = [layer(lp) for lp in layers] if isinstance(layers, (list, tuple)) else layer(layers)
    return dataclasses.replace(cfg, num_kv_heads=tp), {**params, "layers": layers}


def block_columns(w, sizes: tuple[int, ...], tp: int):
    """[..., sum(sizes)] with parts laid end to end -> [..., tp, sum(sizes) / tp], shard d
    holding the d-th tp-th of every part, in part order."""
    parts, start = [], 0
    for n in sizes:
        parts.append(w[..., start : start + n].reshape(*w.shape[:-1], tp, n // tp))
        start += n
    return jax.numpy.concatenate(parts, axis=-1)


def param_specs(params, tp: int) -> dict:
    """PartitionSpecs for a (TP-blocked) Llama param pytree, stacked or per-layer."""

    def spec(path, leaf):
        # An FP8 weight's arrays (path ... name, .w / .scale) take the weight's spec: the scale's
        # [in_blocks, out] has the output axis last and the (blocked) input axis before it.
        keys = [p.key for p in path if hasattr(p, "key")]
        name = keys[-1] if keys else None
        nd = leaf.ndim
        if getattr(path[-1], "name", None) == "scale" and name in ("wo", "w_down") and leaf.shape[-2] % tp:
            return P()  # one scale row (per channel) for all of a row-parallel weight's shards
        lead = (None,) * (nd - 2)  # the stacked layer axis, when present
        if name == "embed":
            return P(TENSOR, None) if leaf.shape[0] % tp == 0 else P()
        if name == "lm_head":
            return P(None, TENSOR) if leaf.shape[1] % tp == 0 else P()
        if name in ("wqkv", "w_gate_up"):  # [..., H, tp, n]
            return P(*(None,) * (nd - 2), TENSOR, None)
        if name == "bqkv":  # [..., tp, n]
            return P(*(None,) * (nd - 2), TENSOR, None)
        if name in ("wo", "w_down"):  # row-parallel: [..., in, H]
            return P(*lead, TENSOR, None)
        if name in ("experts_gate_up", "experts_down"):  # expert-parallel: [..., E, in, out]
            return P(*(None,) * (nd - 3), TENSOR, None, None)
        return P()  # norms (replicated)

    return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(cfg: ModelConfig, params, mesh: Mesh):
    """(cfg, params) laid out and placed for tensor parallelism over mesh's "tensor" axis.
    Returns cfg unchanged unless KV heads were repeated. tp == 1: placed, not re-laid."""
    tp = tp_size_of(mesh)
    check_tp_config(cfg, tp)
    cfg, params = replicate_kv_heads(cfg, params, tp)
    I = cfg.intermediate_size

    def layer(lp):
        lp = dict(lp)
        qkv = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        # jax.tree.map: an FP8 weight's scale is blocked as its weight (the output axis is last in both).
        lp["wqkv"] = jax.tree.map(lambda a: block_columns(a, qkv, tp), lp["wqkv"])
        if "bqkv" in lp:
            lp["bqkv"] = block_columns(lp["bqkv"], qkv, tp)
        if "w_gate_up" in lp:  # a dense MLP (an MoE layer's experts are split whole instead)
            lp["w_gate_up"] = jax.tree.map(lambda a: block_columns(a, (I, I), tp), lp["w_gate_up"])
        return lp

    layers = params["layers"]
    layers = [layer(lp) for lp in layers] if isinstance(layers, (list, tuple)) else layer(layers)
    params = {**params, "layers": layers}
    specs = param_specs(params, tp)
    return cfg, jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def kv_pool_spec() -> P:
    """[L, pages, page_size, Hkv, D]: each shard keeps its KV heads of every page."""
    return P(None, None, None, TENSOR, None)


def replicate(tree, mesh: Mesh):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), tree)

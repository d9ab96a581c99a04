"""Mixture-of-Experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss) as pure functions.

The router weighs the top-k experts as HF does (softmax over all logits in f32, top k,
renormalised when norm_topk_prob); experts run as one grouped matmul (`ragged_dot` over the
T*k assignments sorted by expert), so shapes are static whatever the routing. Expert
parallelism sends each assignment to its expert's shard by all_to_all and back.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jspec.config.model import ModelConfig
from jspec.distributed.dp_attention import in_rank_region
from jspec.distributed.mesh import DATA, EXPERT, TENSOR


def route(
    h: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """h [T, H], router [H, E] (+ bias [E]) -> (weights [T, k] float32, expert ids [T, k] int32)."""
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class ExpertMlp(NamedTuple):
    """One layer's experts (this shard's): w_gate_up [E, H, 2I] (gate columns, then up),
    w_down [E, I, H]; gpt-oss's biases b_gate_up [E, 2I] and b_down [E, H], and its clamped
    SwiGLU (limit, alpha); None where the family has none."""

    w_gate_up: jax.Array
    w_down: jax.Array
    b_gate_up: jax.Array | None = None
    b_down: jax.Array | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0


def layer_experts(cfg: ModelConfig, lp) -> ExpertMlp:
    return ExpertMlp(
        lp["experts_gate_up"],
        lp["experts_down"],
        lp.get("experts_b_gate_up"),
        lp.get("experts_b_down"),
        cfg.swiglu_limit,
        cfg.swiglu_alpha,
    )


def _gated(gate: jax.Array, up: jax.Array, limit: float | None, alpha: float) -> jax.Array:
    if limit is None:
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)


def grouped_swiglu(xs: jax.Array, group_sizes: jax.Array, mlp: ExpertMlp, row_experts: jax.Array | None = None):
    """Rows of xs [M, H] sorted by expert, group_sizes [G] rows per expert -> [M, H] in xs.dtype.

    row_experts [M]: each row's expert (needed with biases); ids past G (padding) read any bias.
    Rows past sum(group_sizes) belong to no expert (padding); their output is undefined.
    The output is cast to the activation dtype before it is weighted, as HF's experts do.
    """
    inter = mlp.w_down.shape[1]
    gate_up = jax.lax.ragged_dot(xs, mlp.w_gate_up, group_sizes, preferred_element_type=jnp.float32)
    rows = None if row_experts is None else jnp.clip(row_experts, 0, mlp.w_gate_up.shape[0] - 1)
    if mlp.b_gate_up is not None:
        gate_up = gate_up + mlp.b_gate_up[rows].astype(jnp.float32)
    act = _gated(gate_up[:, :inter], gate_up[:, inter:], mlp.swiglu_limit, mlp.swiglu_alpha).astype(xs.dtype)
    out = jax.lax.ragged_dot(act, mlp.w_down, group_sizes, preferred_element_type=jnp.float32)
    if mlp.b_down is not None:
        out = out + mlp.b_down[rows].astype(jnp.float32)
    return out.astype(xs.dtype)


def _combine(weights: jax.Array, per_assignment: jax.Array) -> jax.Array:
    """weights [T, k], per_assignment [T*k, H] in (token, slot) order -> [T, H] float32."""
    T, k = weights.shape
    y = per_assignment.reshape(T, k, -1).astype(jnp.float32)
    return jnp.einsum("tk,tkh->th", weights, y)


def moe_experts(h: jax.Array, weights: jax.Array, experts: jax.Array, mlp: ExpertMlp) -> jax.Array:
    """Weighted sum of each token's chosen experts, all experts local: [T, H] float32."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    # Stable, so a token's assignments keep their order within an expert's group.
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=mlp.w_gate_up.shape[0])
    ys = grouped_swiglu(h[order // k], sizes, mlp, flat[order])
    # order is a permutation, so this scatter writes each row once (deterministic, no adds).
    return _combine(weights, jnp.zeros_like(ys).at[order].set(ys))


def shared_expert(h: jax.Array, lp) -> jax.Array:
    """Qwen2-MoE's always-on expert, scaled by sigmoid(h @ shared_gate): [T, H] float32."""
    inter = lp["shared_down"].shape[0]
    gate_up = jnp.dot(h, lp["shared_gate_up"], preferred_element_type=jnp.float32)
    act = (jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]).astype(h.dtype)
    out = jnp.dot(act, lp["shared_down"], preferred_element_type=jnp.float32).astype(h.dtype)
    gate = jax.nn.sigmoid(jnp.dot(h, lp["shared_gate"], preferred_element_type=jnp.float32))
    return gate * out.astype(jnp.float32)


def moe_mlp(cfg: ModelConfig, lp, h: jax.Array) -> jax.Array:
    """The sparse MLP on normed input h [T, H], every expert on this device: [T, H] in h.dtype."""
    weights, experts = route(h, lp["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob, lp.get("router_bias"))
    y = moe_experts(h, weights, experts, layer_experts(cfg, lp))
    if cfg.shared_expert_intermediate_size:
        y = y + shared_expert(h, lp)
    return y.astype(h.dtype)


# ---------------------------------------------------------------------------
# Expert parallelism
# ---------------------------------------------------------------------------


def moe_experts_ep(
    h: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    mlp: ExpertMlp,
    axis_name: str = EXPERT,
) -> jax.Array:
    """moe_experts inside shard_map: h [T, H] this shard's tokens, experts [T, k] global ids,
    mlp this shard's experts, w_gate_up [E/ep, H, 2I] and w_down [E/ep, I, H] (shard s owns
    experts s*E/ep .. (s+1)*E/ep - 1). Returns [T, H] float32 for this shard's tokens.

    Capacity: each (source, destination) buffer has T*k slots, the number of
    assignments the source has, so no token is ever dropped whatever the routing
    (exact, as greedy speculative decoding needs: a dropped token would change the
    logits with the batch). The price is an ep*T*k-row buffer each way, mostly
    padding when routing is balanced; a smaller capacity would need a drop policy.
    """
    ep = jax.lax.axis_size(axis_name)
    local = mlp.w_gate_up.shape[0]
    T, k = experts.shape
    cap = T * k
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_e = flat[order]
    # Sorting by expert also sorts by destination shard; pos = rank within the destination.
    dest = sorted_e // local
    counts = jnp.bincount(dest, length=ep)
    pos = jnp.arange(cap, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest]
    send_x = jnp.zeros((ep, cap, h.shape[1]), h.dtype).at[dest, pos].set(h[order // k])
    # Empty slots carry the out-of-range id `local`: they sort after every group and count in none.
    send_e = jnp.full((ep, cap), local, jnp.int32).at[dest, pos].set(sorted_e % local)

    # recv[s] = what shard s sent here.
    recv_x = jax.lax.all_to_all(send_x, axis_name, 0, 0, tiled=True).reshape(ep * cap, -1)
    recv_e = jax.lax.all_to_all(send_e, axis_name, 0, 0, tiled=True).reshape(ep * cap)
    lorder = jnp.argsort(recv_e, stable=True)
    ys = grouped_swiglu(recv_x[lorder], jnp.bincount(recv_e, length=local), mlp, recv_e[lorder])
    back = jnp.zeros_like(ys).at[lorder].set(ys).reshape(ep, cap, -1)

    # The inverse all_to_all: back[d] = results of what this shard sent to d, slot for slot.
    back = jax.lax.all_to_all(back, axis_name, 0, 0, tiled=True)
    ys_sorted = back[dest, pos]
    return _combine(weights, jnp.zeros_like(ys_sorted).at[order].set(ys_sorted))


def moe_mlp_ep(cfg: ModelConfig, lp, h: jax.Array, axis_name: str = EXPERT) -> jax.Array:
    """moe_mlp inside shard_map over axis_name: lp's expert weights are this shard's slice,
    the router and shared expert are replicated, h [T, H] are this shard's tokens."""
    weights, experts = route(h, lp["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob, lp.get("router_bias"))
    y = moe_experts_ep(h, weights, experts, layer_experts(cfg, lp), axis_name)
    if cfg.shared_expert_intermediate_size:
        y = y + shared_expert(h, lp)
    return y.astype(h.dtype)


def ep_param_specs(lp, axis_name: str = EXPERT) -> dict[str, P]:
    """PartitionSpecs of one sparse layer's weights under expert parallelism."""
    return {name: P(axis_name) if name.startswith("experts_") else P() for name in lp}


def moe_mlp_expert_parallel(
    cfg: ModelConfig, mesh: Mesh | None, lp, h: jax.Array, axis_name: str = EXPERT, outer_axes: tuple[str, ...] = ()
) -> jax.Array:
    """moe_mlp with experts and tokens split over mesh axis axis_name (E divisible by its
    size; tokens are padded to a multiple of it): a shard_map of moe_mlp_ep, for callers
    outside any shard_map. mesh None: the current mesh (jax.set_mesh). outer_axes: axes an
    enclosing shard_map already splits (DP attention's ranks, each with its own tokens and
    its block of experts): the experts span them too, so the all_to_all does."""
    shape = (mesh or jax.sharding.get_abstract_mesh()).shape
    ep = shape[axis_name]
    total = ep * int(np.prod([shape[a] for a in outer_axes]))
    if cfg.num_experts % total:
        raise ValueError(f"expert parallelism {total} must divide num_experts ({cfg.num_experts})")
    T = h.shape[0]
    pad = -T % ep  # padding rows route somewhere and are dropped after
    hp = jnp.pad(h, ((0, pad), (0, 0))) if pad else h
    axes = (*outer_axes, axis_name) if outer_axes else axis_name
    fn = jax.shard_map(
        lambda lp, h: moe_mlp_ep(cfg, lp, h, axes),
        mesh=mesh,
        in_specs=(ep_param_specs(lp, axis_name), P(axis_name)),
        out_specs=P(axis_name),
    )
    return fn(lp, hp)[:T]


def moe_mlp_on_mesh(cfg: ModelConfig, lp, h: jax.Array) -> jax.Array:
    """The model's sparse MLP: expert-parallel over the current mesh's "tensor" axis when there
    is one (jspec.distributed shards a MoE model's experts over the TP devices, i.e. EP = TP, as
    SGLang's --ep-size equal to --tp-size), else every expert local."""
    if in_rank_region():  # DP attention: this rank's tokens, experts over every rank's devices
        return moe_mlp_expert_parallel(cfg, None, lp, h, axis_name=TENSOR, outer_axes=(DATA,))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TENSOR not in mesh.axis_names or mesh.shape[TENSOR] == 1:
        return moe_mlp(cfg, lp, h)
    return moe_mlp_expert_parallel(cfg, None, lp, h, axis_name=TENSOR)

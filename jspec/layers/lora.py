"""LoRA on the device: every token's adapter delta added to a fused projection.

The pool's layout (jspec.lora.pool) appends each adapter slot's A columns to the model's
fused weight, so a projection's matmul yields [y | u]; the delta is mask(u) @ B, with the
mask scaling each token's own slot's columns by the adapter's scale and zeroing the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.layers.matmul import dense_f32


class LoraWeights(NamedTuple):
    """The pool's device arrays other than the a_P columns (which ride in the model's
    weights): a step argument. See the module docstring for the layout."""

    layers: dict | list  # {"b_qkv", "b_gate_up", "b_o", "b_down"}: [L, N, out] arrays when the model's layers
    # are stacked, or one dict of [N, out] arrays per layer when they are per-layer arrays
    scale: jax.Array  # [S] float32, scale of slot index + 1 (0 where empty)


class LoraBatch(NamedTuple):
    """What a forward needs for LoRA: the pool and each token's slot."""

    weights: LoraWeights
    token_slots: jax.Array  # [T] int32, 0 = no adapter


def slot_mask(weights: LoraWeights, token_slots: jax.Array) -> jax.Array:
    """[T, S] float32: each token's scale on its own slot, zero elsewhere (all zero for slot 0)."""
    S = weights.scale.shape[0]
    return (token_slots[:, None] == jnp.arange(1, S + 1, dtype=jnp.int32)[None]) * weights.scale[None]


def lora_dense(layer: dict, mask: jax.Array, x: jax.Array, w: jax.Array, projection: str) -> jax.Array:
    """x [T, in] @ P's weight plus each token's delta, float32. w: the weight with its a_P
    columns appended, [in, out + N] (-> [T, out]) or, column-parallel under tensor
    parallelism, [in, tp, out / tp + N] with a_P on every shard (-> [T, tp, out / tp]);
    layer: one layer's pool arrays; mask: slot_mask's [T, S]."""
    if w.ndim == 2:
        yu = dense_f32(x, w)
    else:
        yu = jnp.einsum("ti,isn->tsn", x, w, preferred_element_type=jnp.float32)
    return add_lora_delta(yu, mask, layer["b_" + projection], x.dtype)


def add_lora_delta(yu: jax.Array, mask: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """[y | u] (float32, out of a weight with a_P appended) -> y + mask(u) @ b, float32.
    yu [T, out + N] with b [N, out], or blocked yu [T, tp, out / tp + N] with b [N, tp, out / tp]."""
    T, S, N = yu.shape[0], mask.shape[1], b.shape[0]
    y, u = yu[..., :-N], yu[..., -N:]  # [T, (tp,) out], [T, (tp,) S * G * r]
    lead = u.shape[:-1]
    u = (u.reshape(*lead, S, -1) * mask.reshape(T, *(1,) * (u.ndim - 2), S, 1)).reshape(*lead, N).astype(dtype)
    # The delta comes out in the activations' dtype and is widened for the add: a float32 dot
    # followed by the add is a bias-add XLA folds into the B matmul (cuBLAS beta = 1), which
    # first copies the y slice into a buffer of its own; this way the add fuses into y's consumer.
    if b.ndim == 2:
        delta = jnp.dot(u, b.astype(dtype), preferred_element_type=dtype)
    else:  # each shard its own columns of B, from its own copy of u: no communication
        delta = jnp.einsum("tsk,ksn->tsn", u, b.astype(dtype), preferred_element_type=dtype)
    return y + delta.astype(jnp.float32)

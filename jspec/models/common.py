"""What every decoder family shares: the norm, the layer loop, the capture of residual
streams, the LM head and the forward's outputs.

models/llama.py and models/deepseek.py both build on these; neither imports the other
(models/forward.py picks the family).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.layers.matmul import dense_f32


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [N, V] float32, for batch.logits_indices
    hidden: jax.Array  # [T, H] final-normed hidden state of every row (the EAGLE-1 draft input)
    captured: jax.Array | None  # [C, T, H] residual stream entering each capture layer


def compute_logits(params, cfg: ModelConfig, hidden_normed: jax.Array) -> jax.Array:
    """f32 logits of final-normed hidden states: the LM head, divided by Granite's
    logits_scaling, soft-capped for Gemma 2."""
    logits = lm_head_logits(params, hidden_normed)
    if cfg.logits_divisor != 1.0:
        logits = logits / cfg.logits_divisor
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def lm_head_logits(params, h: jax.Array) -> jax.Array:
    """h [T, H] -> f32 logits [T, V] from params' lm_head [H, V], or the tied embedding [V, H].

    The tied case contracts the embedding's own axis: written as h @ embed.T, XLA:CPU
    materialises the transposed table on every call."""
    if "lm_head" in params:
        return dense_f32(h, params["lm_head"])
    return jax.lax.dot_general(h, params["embed"], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@jax.tree_util.register_pytree_node_class
class UnrolledStack(dict):
    """Stacked layer weights (a dict of arrays with a leading layer axis) that run_layers
    unrolls, each layer's weights a static slice of the stack: a program takes one argument
    per weight kind instead of one per layer and weight (what a launch pays per argument),
    and compiles every layer as the per-layer lists do."""

    def tree_flatten(self):
        keys = tuple(sorted(self))
        return tuple(self[k] for k in keys), keys

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(zip(keys, values))


def run_layers(layers, body, carry):
    """carry = body(carry, lp, layer) for every layer, in order.

    layers is a dict of arrays stacked on a leading layer axis, run as one lax.scan (the
    layer body compiles once, whatever the depth), or a list of per-layer dicts, run as an
    unrolled loop (each layer compiled on its own, no weight ever sliced out of a stack), or
    an UnrolledStack, unrolled over static slices of the stack.
    layer is the traced layer index under the scan, a Python int when unrolled.
    """
    if isinstance(layers, (list, tuple)):
        for i, lp in enumerate(layers):
            carry = body(carry, lp, i)
        return carry
    if isinstance(layers, UnrolledStack):
        for i in range(len(next(iter(jax.tree.leaves(layers))))):
            carry = body(carry, jax.tree.map(lambda w: w[i], dict(layers)), i)
        return carry
    num_layers = len(next(iter(jax.tree.leaves(layers))))
    if num_layers == 1:  # a static slice of a one-layer stack is free
        return body(carry, jax.tree.map(lambda a: a[0], layers), 0)

    def step(carry, xs):
        lp, layer = xs
        return body(carry, lp, layer), None

    return jax.lax.scan(step, carry, (layers, jnp.arange(num_layers, dtype=jnp.int32)))[0]


def store_capture(captured: jax.Array | None, capture_layers: tuple[int, ...], layer, x: jax.Array):
    """captured[j] = x when layer is capture_layers[j]. A select, not a branch: a conditional
    inside the layer loop would cost the GPU a host round trip per layer."""
    if captured is None:
        return None
    if isinstance(layer, int):
        return captured.at[capture_layers.index(layer)].set(x) if layer in capture_layers else captured
    hit = jnp.asarray(capture_layers, jnp.int32) == layer
    j = jnp.argmax(hit)
    return captured.at[j].set(jnp.where(jnp.any(hit), x, captured[j]))


def unstack_layers(params):
    """Stacked layer weights -> a list of per-layer dicts. Each is a copy on the device: the
    stack is freed only when its last holder drops it."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = len(jax.tree.leaves(layers)[0])
    per_layer = [dict() for _ in range(n)]
    for name in list(layers):
        stacked = layers[name]
        for i in range(n):
            per_layer[i][name] = stacked[i]  # an Fp8Weight indexes its weight and scale alike
    return {**params, "layers": per_layer}

"""EAGLE and EAGLE-3 draft heads: pure functions over the draft param pytree.

The draft's KV entry at position t holds (token x_{t+1}, feature of position t) and its
output there predicts x_{t+2}. EAGLE fuses [embed ; feature] by fc and reads logits from the
target's head; EAGLE-3 fuses three captured target residual streams, norms embeddings and
hidden separately, and has its own head over a reduced vocabulary (target id = d + d2t[d]).
docs/design-details.md has the full computation.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jspec.config.draft import DraftConfig
from jspec.config.model import ModelConfig
from jspec.layers.norm import rms_norm
from jspec.models.common import lm_head_logits, run_layers
from jspec.models.llama import decoder_layer


def layer_config(dcfg: DraftConfig) -> ModelConfig:
    """A ModelConfig describing the draft's decoder layers, so the target's layer code runs them."""
    return ModelConfig(
        family="llama",
        vocab_size=dcfg.vocab_size,
        hidden_size=dcfg.hidden_size,
        intermediate_size=dcfg.intermediate_size,
        num_layers=dcfg.num_layers,
        num_heads=dcfg.num_heads,
        num_kv_heads=dcfg.num_kv_heads,
        head_dim=dcfg.head_dim,
        rms_norm_eps=dcfg.rms_norm_eps,
        rope_theta=dcfg.rope_theta,
        rope_scaling=dcfg.rope_scaling,
        max_position_embeddings=dcfg.max_position_embeddings,
    )


def is_eagle3(dcfg: DraftConfig) -> bool:
    return dcfg.algorithm == "EAGLE3"


def target_feature(dparams, dcfg: DraftConfig, feats: jax.Array) -> jax.Array:
    """Turns target features into the draft's H-dim hidden input (EAGLE-3 fuses 3H -> H)."""
    if is_eagle3(dcfg):
        x = jnp.dot(feats, dparams["fc"], preferred_element_type=jnp.float32)
        if "fc_bias" in dparams:
            x = x + dparams["fc_bias"].astype(jnp.float32)
        return x.astype(feats.dtype)
    return feats


def draft_layers(
    dparams,
    dcfg: DraftConfig,
    embed: jax.Array,
    tokens: jax.Array,  # [T] target-vocabulary ids
    hidden: jax.Array,  # [T, H] draft hidden input (already through target_feature)
    cos: jax.Array,
    sin: jax.Array,
    attend_for_layer: Callable[[int], Callable],
    caches,
):
    """Runs the draft's decoder layers; returns (output hidden [T, H], caches).

    attend_for_layer(i) gives the attention closure of draft layer i (paged
    extend during prefill/draft-extend, prefix+tree attention during draft steps).
    """
    lcfg = layer_config(dcfg)
    emb = embed[tokens].astype(hidden.dtype)
    layers = dparams["layers"]
    if is_eagle3(dcfg):
        x = hidden
    else:
        x = jnp.dot(jnp.concatenate([emb, hidden], -1), dparams["fc"], preferred_element_type=jnp.float32)
        if "fc_bias" in dparams:
            x = x + dparams["fc_bias"].astype(jnp.float32)
        x = x.astype(hidden.dtype)

    def layer_body(carry, lp, layer):
        x, caches = carry
        if is_eagle3(dcfg):
            h = jnp.concatenate(
                [rms_norm(emb, lp["attn_norm"], dcfg.rms_norm_eps), rms_norm(x, lp["hidden_norm"], dcfg.rms_norm_eps)],
                -1,
            )
        elif "attn_norm" in lp:
            h = rms_norm(x, lp["attn_norm"], dcfg.rms_norm_eps)
        else:
            h = x  # EAGLE's first layer has no input norm
        return decoder_layer(lcfg, lp, x, h, cos, sin, attend_for_layer(layer), caches)

    x, caches = run_layers(layers, layer_body, (x, caches))
    return x, caches


def draft_logits(dparams, dcfg: DraftConfig, target_params, out: jax.Array) -> jax.Array:
    """Logits over the draft vocabulary [T, Vd] (float32)."""
    if is_eagle3(dcfg):
        h = rms_norm(out, dparams["final_norm"], dcfg.rms_norm_eps)
    else:
        h = out
    return lm_head_logits(dparams if "lm_head" in dparams else target_params, h)


def to_target_ids(dparams, draft_ids: jax.Array) -> jax.Array:
    if "d2t" in dparams:
        return (draft_ids + dparams["d2t"][draft_ids]).astype(jnp.int32)
    return draft_ids.astype(jnp.int32)


def draft_embed(dparams, target_params) -> jax.Array:
    return dparams["embed"] if "embed" in dparams else target_params["embed"]

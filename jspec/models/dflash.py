"""DFlash block drafter: pure functions over the draft's param pytree (config/dflash.py).

The target's hidden states after a few chosen layers are concatenated and fused into one
context feature per committed token: c = RMSNorm(fc(features)). Every draft layer turns c into
keys and values (its k_proj with Qwen3's per-head k_norm and RoPE at the token's position,
its v_proj), which is all the draft ever keeps of a committed token: context positions are
never queries. A block [root, mask, ..., mask] at the positions after the committed ones then
runs through the layers (input norm, attention, post-attention norm, SwiGLU) with
non-causal attention over the context keys and the whole block, and the final-normed output
at block row i, through the target's LM head, drafts the token at that row's position.
docs/design-details.md, "DFlash", has the layout and the conventions.

Param pytree (weights [in, out], layers stacked on a leading axis Ld, as models/llama.py's):
    fc [len(target_layer_ids) * H, H], hidden_norm [H], final_norm [H],
    layers/{attn_norm, wqkv, q_norm, k_norm, wo, mlp_norm, w_gate_up, w_down}
The embedding and the LM head are the target's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jspec.config.dflash import DFlashConfig
from jspec.config.model import ModelConfig
from jspec.kvcache.pool import KVPool, write_kv
from jspec.layers.matmul import dense_f32
from jspec.layers.norm import rms_norm
from jspec.models.common import lm_head_logits, run_layers
from jspec.models.llama import decoder_layer, rope_cos_sin
from jspec.models.rope import apply_rope


def context_features(dparams, dcfg: DFlashConfig, feats: jax.Array) -> jax.Array:
    """feats [T, len(target_layer_ids) * H] (the captured target states) -> c [T, H]."""
    x = dense_f32(feats, dparams["fc"]).astype(feats.dtype)
    return rms_norm(x, dparams["hidden_norm"], dcfg.layers.rms_norm_eps)


def context_kv(cfg: ModelConfig, lp, c: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array]:
    """One layer's keys (k_norm, then RoPE) and values of context features c [T, H]: the
    k / v columns of its fused projection only, since no context position is a query."""
    T = c.shape[0]
    kv = dense_f32(c, lp["wqkv"][:, cfg.q_size :]).astype(c.dtype)
    k = rms_norm(kv[:, : cfg.kv_size].reshape(T, cfg.num_kv_heads, cfg.head_dim), lp["k_norm"], cfg.rms_norm_eps)
    v = kv[:, cfg.kv_size :].reshape(T, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(k, cos, sin).astype(c.dtype), v


def inject_context(dparams, dcfg: DFlashConfig, pool: KVPool, feats, positions, slots) -> KVPool:
    """Writes the context keys and values of tokens at positions [T] (target features feats
    [T, F]) into every draft layer's cache at flat slots [T] (out of range: dropped)."""
    cfg = dcfg.layers
    c = context_features(dparams, dcfg, feats.astype(pool.k.dtype))
    cos, sin = rope_cos_sin(cfg, positions)

    def body(caches, lp, layer):
        k, v = context_kv(cfg, lp, c, cos, sin)
        layer = jnp.int32(layer) if isinstance(layer, int) else layer
        return write_kv(caches[0], layer, slots, k), write_kv(caches[1], layer, slots, v)

    return KVPool(*run_layers(dparams["layers"], body, (pool.k, pool.v)))


def block_embeddings(target_params, dcfg: DFlashConfig, tokens: jax.Array) -> jax.Array:
    """The block's input: the target's raw embedding rows (no family multiplier), scaled."""
    x = target_params["embed"][tokens]
    if dcfg.input_embedding_scale != 1.0:
        x = x * jnp.asarray(dcfg.input_embedding_scale, x.dtype)
    return x


def block_layers(
    dparams, dcfg: DFlashConfig, x: jax.Array, cos, sin, attend_for_layer: Callable[[object], Callable], caches
):
    """The draft layers over block rows x [T, H] -> (final-normed output [T, H], caches).
    attend_for_layer(layer) gives that layer's attention closure (models/llama.py's contract)."""
    cfg = dcfg.layers

    def body(carry, lp, layer):
        x, caches = carry
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        return decoder_layer(cfg, lp, x, h, cos, sin, attend_for_layer(layer), caches)

    x, caches = run_layers(dparams["layers"], body, (x, caches))
    return rms_norm(x, dparams["final_norm"], cfg.rms_norm_eps), caches


def draft_logits(target_params, dcfg: DFlashConfig, h: jax.Array) -> jax.Array:
    """f32 logits [T, V] of final-normed draft outputs, through the target's raw LM head."""
    logits = lm_head_logits(target_params, h)
    if dcfg.output_multiplier != 1.0:
        logits = logits * dcfg.output_multiplier
    if dcfg.final_logit_softcap is not None:
        logits = dcfg.final_logit_softcap * jnp.tanh(logits / dcfg.final_logit_softcap)
    return logits


def dense_block_hidden(
    dparams, dcfg: DFlashConfig, target_params, feats: jax.Array, tokens: jax.Array, anchors: jax.Array
) -> jax.Array:
    """Blocks drafted from scratch, without a cache: the reference of the paged path and the
    training forward. feats [S, F]: target features of positions 0..S-1; tokens [N, Bs]: each
    block's rows ([anchor token, mask, ...]), block n at positions anchors[n] + 0..Bs-1,
    seeing the context positions < anchors[n] and its own rows (all of them) -> final-normed
    outputs [N, Bs, H]."""
    cfg = dcfg.layers
    S = feats.shape[0]
    N, Bs = tokens.shape
    group = cfg.num_heads // cfg.num_kv_heads
    c = context_features(dparams, dcfg, feats)
    ctx_cos, ctx_sin = rope_cos_sin(cfg, jnp.arange(S, dtype=jnp.int32))
    positions = (anchors[:, None] + jnp.arange(Bs, dtype=jnp.int32)[None]).reshape(-1)
    cos, sin = rope_cos_sin(cfg, positions)
    ctx_visible = jnp.arange(S)[None, :] < anchors[:, None]  # [N, S]

    def body(carry, lp, layer):
        x = carry
        ck, cv = context_kv(cfg, lp, c, ctx_cos, ctx_sin)  # [S, Hkv, D]

        def attend(q, k, v, caches):
            qb = q.astype(jnp.float32).reshape(N, Bs, cfg.num_kv_heads, group, cfg.head_dim) * cfg.sm_scale
            kb = k.astype(jnp.float32).reshape(N, Bs, cfg.num_kv_heads, cfg.head_dim)
            vb = v.astype(jnp.float32).reshape(N, Bs, cfg.num_kv_heads, cfg.head_dim)
            s_ctx = jnp.einsum("nqhgd,shd->nhgqs", qb, ck.astype(jnp.float32))
            s_ctx = jnp.where(ctx_visible[:, None, None, None, :], s_ctx, -jnp.inf)
            s_blk = jnp.einsum("nqhgd,nkhd->nhgqk", qb, kb)
            p = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
            out = jnp.einsum("nhgqs,shd->nqhgd", p[..., :S], cv.astype(jnp.float32))
            out = out + jnp.einsum("nhgqk,nkhd->nqhgd", p[..., S:], vb)
            return out.reshape(N * Bs, cfg.num_heads, cfg.head_dim).astype(q.dtype), caches

        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        return decoder_layer(cfg, lp, x, h, cos, sin, attend, ())[0]

    x = block_embeddings(target_params, dcfg, tokens.reshape(-1)).astype(feats.dtype)
    x = run_layers(dparams["layers"], body, x)
    return rms_norm(x, dparams["final_norm"], cfg.rms_norm_eps).reshape(N, Bs, -1)

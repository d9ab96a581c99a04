"""Pure-functional DeepSeek-V3 (and V2) decoder over a paged latent KV cache.

Multi-head latent attention (kernels/mla_ref.py explains its two forms): prefill-style batches
(new tokens without a tree mask) attend in the expanded form, decode and verify in the
absorbed form; both write the same latent cache entry per token. The MLP is SwiGLU on the
first dense layers and, after them, DeepSeek's MoE: a sigmoid router with a correction bias
that picks experts inside the best groups, routed weights scaled, and shared experts always
on (V2: softmax scores, groups by their best expert). RoPE is YaRN with DeepSeek's mscale, on
interleaved pairs.

`forward` has llama.forward's contract (pool in and out, ForwardOutput); models/forward.py runs
it for a config with `deepseek` set. Layers are per-layer dicts (dense and sparse layers differ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config.deepseek import DeepseekConfig
from jspec.config.model import ModelConfig, RopeScaling
from jspec.kernels.mla_ref import mla_extend_expanded_ref
from jspec.kvcache.pool import KVPool, write_kv
from jspec.layers.attention import mla_kernels_for
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.matmul import dense_f32
from jspec.layers.norm import add_rms_norm, rms_norm
from jspec.models.common import ForwardOutput, compute_logits, run_layers, store_capture
from jspec.models.moe import ExpertMlp, moe_experts
from jspec.models.rope import inv_freq


def yarn_inv_freq(ds: DeepseekConfig, rope_theta: float) -> np.ndarray:
    """RoPE inverse frequencies of the qk_rope_head_dim dims, YaRN-blended when yarn_factor > 1
    (transformers' _compute_yarn_parameters; the blend is rope.py's)."""
    yarn = None
    if ds.yarn_factor != 1.0:
        yarn = RopeScaling(
            ds.yarn_factor,
            rope_type="yarn",
            original_max_position_embeddings=ds.yarn_original_max_position_embeddings,
            beta_fast=ds.yarn_beta_fast,
            beta_slow=ds.yarn_beta_slow,
            truncate=ds.yarn_truncate,
        )
    return inv_freq(rope_theta, ds.qk_rope_head_dim, yarn)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array):
    ds = cfg.deepseek
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(yarn_inv_freq(ds, cfg.rope_theta))[None]
    return jnp.cos(angles) * ds.yarn_attention_factor, jnp.sin(angles) * ds.yarn_attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x [T, heads, P]; cos/sin [T, P/2]. Interleaved pairs (x0, x1), (x2, x3), ... come out
    de-interleaved (evens rotated, then odds), as transformers writes them; q and k get the
    same permutation, so their products are those of the interleaved rotation."""
    x32 = x.astype(jnp.float32)
    if interleave:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = jnp.split(x32, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return dense_f32(x, w).astype(x.dtype)


def mla_inputs(cfg: ModelConfig, lp, h: jax.Array, cos, sin):
    """Normed input h [T, H] -> q_nope [T, Hq, nope], RoPE'd q_rope [T, Hq, rope] and the cache
    entry latent [T, latent_dim] (normed c_kv | RoPE'd shared key)."""
    ds = cfg.deepseek
    T = h.shape[0]
    if "wq" in lp:
        q = _linear(h, lp["wq"])
    else:
        q = _linear(rms_norm(_linear(h, lp["wq_a"]), lp["q_a_norm"], cfg.rms_norm_eps), lp["wq_b"])
    q = q.reshape(T, cfg.num_heads, ds.qk_head_dim)
    q_nope, q_rope = q[..., : ds.qk_nope_head_dim], q[..., ds.qk_nope_head_dim :]
    q_rope = apply_rope(q_rope, cos, sin, ds.rope_interleave)
    kv = _linear(h, lp["wkv_a"])
    c = rms_norm(kv[:, : ds.kv_lora_rank], lp["kv_a_norm"], cfg.rms_norm_eps)
    k_rope = apply_rope(kv[:, None, ds.kv_lora_rank :], cos, sin, ds.rope_interleave)[:, 0]
    return q_nope, q_rope, jnp.concatenate([c, k_rope], axis=-1)


def absorb_query(q_nope: jax.Array, q_rope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """[T, Hq, nope], [T, Hq, rope], w_uk [Hq, nope, R] -> [T, Hq, R + rope]: the query that
    scores the latent directly."""
    q_lat = jnp.einsum("thn,hnr->thr", q_nope, w_uk, preferred_element_type=jnp.float32)
    return jnp.concatenate([q_lat.astype(q_rope.dtype), q_rope], axis=-1)


def mla_attention(cfg, lp, q_nope, q_rope, cache, layer, batch: ForwardBatch, mode: AttentionMode, mask):
    """Attention of the new tokens over the latent cache (already holding them): [T, Hq, v]."""
    ds = cfg.deepseek
    # Decode and verify have Pallas kernels (absorbed); prefill runs the expanded reference on
    # every backend.
    mla_decode, mla_extend = mla_kernels_for(mode.backend, q_nope.shape[1])
    if not mode.decode_only and mask is None:
        out = mla_extend_expanded_ref(
            q_nope,
            q_rope,
            cache,
            lp["w_uk"],
            lp["w_uv"],
            layer,
            batch.seq_lens,
            batch.page_tables,
            batch.query_start,
            sm_scale=ds.sm_scale,
            max_q_len=mode.max_q_len,
        )
        return out.astype(q_rope.dtype)
    q = absorb_query(q_nope, q_rope, lp["w_uk"])
    if mode.decode_only and mask is None:
        lat = mla_decode(
            q, cache, layer, batch.seq_lens, batch.page_tables, kv_lora_rank=ds.kv_lora_rank, sm_scale=ds.sm_scale
        )
    else:
        lat = mla_extend(
            q,
            cache,
            layer,
            batch.seq_lens,
            batch.page_tables,
            batch.query_start,
            kv_lora_rank=ds.kv_lora_rank,
            sm_scale=ds.sm_scale,
            max_q_len=mode.max_q_len,
            mask=mask,
        )
    out = jnp.einsum("thr,hvr->thv", lat, lp["w_uv"], preferred_element_type=jnp.float32)
    return out.astype(q_rope.dtype)


def route(ds: DeepseekConfig, h: jax.Array, router: jax.Array, bias, top_k: int, norm: bool):
    """DeepSeek's routing (config/deepseek.py's topk_method), in float32: h [T, H] ->
    (weights [T, k], experts [T, k]). bias: V3's correction bias [E], None for V2."""
    T = h.shape[0]
    E = router.shape[1]
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32), precision="highest")
    if ds.topk_method == "noaux_tc":
        scores = jax.nn.sigmoid(logits)
        choice = scores + bias.astype(jnp.float32)
        per_group = jax.lax.top_k(choice.reshape(T, ds.n_group, E // ds.n_group), min(2, E // ds.n_group))[0]
        group_scores = jnp.sum(per_group, axis=-1)
    else:
        scores = choice = jax.nn.softmax(logits, axis=-1)
        group_scores = jnp.max(choice.reshape(T, ds.n_group, E // ds.n_group), axis=-1)
    if ds.topk_method != "greedy":
        _, best_groups = jax.lax.top_k(group_scores, ds.topk_group)
        keep = jnp.zeros((T, ds.n_group), bool).at[jnp.arange(T)[:, None], best_groups].set(True)
        # V3 masks to -inf; V2 zeroes the scores, which ranks the same (softmax scores are > 0).
        choice = jnp.where(jnp.repeat(keep, E // ds.n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if norm:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * ds.routed_scaling_factor, experts.astype(jnp.int32)


def swiglu(h: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    gate_up = dense_f32(h, w_gate_up)
    half = gate_up.shape[-1] // 2
    act = (jax.nn.silu(gate_up[:, :half]) * gate_up[:, half:]).astype(h.dtype)
    return dense_f32(act, w_down)


def moe_mlp(cfg: ModelConfig, lp, h: jax.Array) -> jax.Array:
    """Routed experts plus the shared experts on normed h [T, H]: [T, H] float32."""
    weights, experts = route(
        cfg.deepseek, h, lp["router"], lp.get("router_bias"), cfg.num_experts_per_tok, cfg.norm_topk_prob
    )
    y = moe_experts(h, weights, experts, ExpertMlp(lp["experts_gate_up"], lp["experts_down"]))
    if "shared_gate_up" in lp:
        y = y + swiglu(h, lp["shared_gate_up"], lp["shared_down"]).astype(h.dtype).astype(jnp.float32)
    return y


def mlp(cfg: ModelConfig, lp, h: jax.Array) -> jax.Array:
    if "router" in lp:
        return moe_mlp(cfg, lp, h)
    return swiglu(h, lp["w_gate_up"], lp["w_down"])


def paged_mla_attend(cfg: ModelConfig, mode: AttentionMode, batch: ForwardBatch, layer, mask=None):
    """attend(lp, q_nope, q_rope, latent, cache) -> ([T, Hq, v], cache) over the paged latent
    cache: writes the new tokens' latents, then attends (expanded or absorbed, see mla_attention)."""

    def attend(lp, q_nope, q_rope, latent, cache):
        cache = write_kv(cache, layer, batch.slots, latent[:, None, :])
        return mla_attention(cfg, lp, q_nope, q_rope, cache, layer, batch, mode, mask), cache

    return attend


def absorbed_attend(attend):
    """The MLA attend of an attention closure over latents (speculative/beams.py's
    attend(q, k_new, v_new, caches) with values read from the keys): absorbed queries in,
    per-head values out."""

    def mla(lp, q_nope, q_rope, latent, caches):
        q = absorb_query(q_nope, q_rope, lp["w_uk"])
        lat, caches = attend(q, latent[:, None, :], latent[:, None, :0], caches)
        out = jnp.einsum("thr,hvr->thv", lat, lp["w_uv"], preferred_element_type=jnp.float32)
        return out.astype(q_rope.dtype), caches

    return mla


def decoder_layer(cfg: ModelConfig, lp, x, h, cos, sin, attend, caches, attention_backend: str | None = None):
    """One DeepSeek layer on residual x with attention input h (normed): (x, caches).
    attention_backend (the step's, where the caller has one) picks the add-and-norm's kernel family."""
    q_nope, q_rope, latent = mla_inputs(cfg, lp, h, cos, sin)
    attn, caches = attend(lp, q_nope, q_rope, latent, caches)
    # The o projection's float32 output is rounded by the add, with the norm in one call (layers/norm.py).
    o = dense_f32(attn.reshape(x.shape[0], -1), lp["wo"])
    x, h2 = add_rms_norm(x, o, lp["mlp_norm"], cfg.rms_norm_eps, attention_backend)
    return x + mlp(cfg, lp, h2).astype(x.dtype), caches


def forward(
    params, cfg: ModelConfig, kv: KVPool, batch: ForwardBatch, mode: AttentionMode, capture_layers=(), mask=None
):
    """llama.forward for DeepSeek-V3: kv.k is the latent cache [L, P, S, 1, latent_dim]."""
    dtype = params["embed"].dtype
    x = params["embed"][batch.tokens].astype(dtype)
    T = x.shape[0]
    cos, sin = rope_cos_sin(cfg, batch.positions)
    captured = jnp.zeros((len(capture_layers), T, cfg.hidden_size), dtype) if capture_layers else None

    def body(carry, lp, layer):
        x, cache, captured = carry
        captured = store_capture(captured, capture_layers, layer, x)
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        layer = jnp.int32(layer) if isinstance(layer, int) else layer
        attend = paged_mla_attend(cfg, mode, batch, layer, mask)
        x, cache = decoder_layer(cfg, lp, x, h, cos, sin, attend, cache, mode.backend)
        return x, cache, captured

    x, cache, captured = run_layers(params["layers"], body, (x, kv.k, captured))
    captured = store_capture(captured, capture_layers, cfg.num_layers, x)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = compute_logits(params, cfg, h[batch.logits_indices])
    return KVPool(cache, kv.v), ForwardOutput(logits, h, captured)

"""Pure-functional Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and their MoE
kin Qwen2-MoE, Qwen3-MoE, Mixtral: see moe.py) over paged KV.

`forward` runs one ragged token batch (see models/batch.py) through all layers,
writes the new tokens' K/V into the pool, and returns logits only for the rows
asked for, plus the residual stream entering chosen layers (EAGLE-3 drafts
read three of them). Layers are stacked on a leading axis and run under
lax.scan, so compile time does not grow with depth.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config.model import ModelConfig
from jspec.distributed.mesh import DATA
from jspec.kvcache.pool import KVPool, write_kv
from jspec.layers.attention import paged_attention
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.lora import LoraBatch, add_lora_delta, lora_dense, slot_mask
from jspec.layers.matmul import dense_f32
from jspec.models.moe import moe_mlp_on_mesh


class ForwardOutput(NamedTuple):
    logits: jax.Array  # [N, V] float32, for batch.logits_indices
    hidden: jax.Array  # [T, H] final-normed hidden state of every row (the EAGLE-1 draft input)
    captured: jax.Array | None  # [C, T, H] residual stream entering each capture layer


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies, with Llama-3's smooth long-context rescaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, D]; cos/sin: [T, D/2]. Half-split rotation (HF's rotate_half convention)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return dense_f32(x, w).astype(x.dtype)


def _project(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [T, in] @ w -> f32 [T, shards, n]; w is [in, n] (one shard) or [in, tp, n / tp]."""
    if w.ndim == 2:
        return dense_f32(h, w)[:, None, :]
    return jnp.einsum("ti,isn->tsn", h, w, preferred_element_type=jnp.float32)


def qkv_heads(cfg: ModelConfig, lp, h: jax.Array, cos, sin):
    """Projects normed input h [T, in] to RoPE'd q [T, Hq, D], k and v [T, Hkv, D]."""
    T = h.shape[0]
    # wqkv [in, n], or the tensor-parallel layout [in, tp, n / tp] (jspec.distributed): q, k, v
    # of each shard's heads side by side, so the split below stays within a shard.
    # With LoRA wqkv carries the pool's columns (jspec.lora.pool).
    qkv = _project_lora(lp, h, "wqkv", "qkv")
    shards = qkv.shape[1]
    if cfg.qkv_bias:
        qkv = qkv + lp["bqkv"].reshape(shards, -1).astype(jnp.float32)
    qkv = qkv.astype(h.dtype)
    ql, kvl = cfg.q_size // shards, cfg.kv_size // shards
    q = qkv[..., :ql].reshape(T, cfg.num_heads, cfg.head_dim)
    k = qkv[..., ql : ql + kvl].reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[..., ql + kvl :].reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def mlp_block(cfg: ModelConfig, lp, x: jax.Array) -> jax.Array:
    """x + SwiGLU(RMSNorm(x)), or x + MoE(RMSNorm(x)) on a sparse layer."""
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    if "router" in lp:
        # The loader gives router and expert weights exactly to cfg.moe_layers (and a scan
        # stacks only alike layers), so the weights present say which block this layer is.
        return x + moe_mlp_on_mesh(cfg, lp, h)
    if lp["w_gate_up"].ndim == 4:  # [in, 1, tp/dp, n]: this DP-attention rank's slice, for every rank's tokens
        return x + dense_mlp_over_ranks(lp, h).astype(x.dtype)
    # [in, 2I], or [in, tp, 2I / tp] (as wqkv); with LoRA, w_gate_up carries the pool's columns
    gate_up = _project_lora(lp, h, "w_gate_up", "gate_up")
    half = gate_up.shape[-1] // 2
    T = x.shape[0]
    gate, up = gate_up[..., :half].reshape(T, -1), gate_up[..., half:].reshape(T, -1)
    return x + _linear_lora(lp, (jax.nn.silu(gate) * up).astype(x.dtype), "w_down", "down")


def dense_mlp_over_ranks(lp, h: jax.Array) -> jax.Array:
    """SwiGLU MLP inside the per-rank shard_map: h [T, H] this rank's (normed) tokens; lp's
    w_gate_up [H, 1, tp/dp, n] and w_down [1, I/dp, H] this rank's slice of the MLP. Every
    rank's tokens are gathered, this slice's partial output is summed over the ranks and each
    rank keeps its own rows (all-gather, then reduce-scatter): [T, H] float32."""
    everyone = jax.lax.all_gather(h, DATA, axis=0, tiled=True)
    gate_up = jnp.einsum("ti,isn->tsn", everyone, lp["w_gate_up"][:, 0], preferred_element_type=jnp.float32)
    if "lora" in lp:
        # The weights carry the pool's A columns (jspec.lora.pool, ranked layouts): gate_up's
        # delta for every rank's tokens (so their slot masks are gathered too), down's u
        # summed over the ranks with y by the same reduce-scatter.
        lw, mask = lp["lora"]
        everyone_mask = jax.lax.all_gather(mask, DATA, axis=0, tiled=True)
        gate_up = add_lora_delta(gate_up, everyone_mask, lw["b_gate_up"][:, 0], h.dtype)
    half = gate_up.shape[-1] // 2
    T = everyone.shape[0]
    act = jax.nn.silu(gate_up[..., :half].reshape(T, -1)) * gate_up[..., half:].reshape(T, -1)
    partial = jnp.dot(act.astype(h.dtype), lp["w_down"][0], preferred_element_type=jnp.float32)
    out = jax.lax.psum_scatter(partial, DATA, scatter_dimension=0, tiled=True)
    return add_lora_delta(out, mask, lw["b_down"], h.dtype) if "lora" in lp else out


def _project_lora(lp, h: jax.Array, name: str, projection: str) -> jax.Array:
    """_project(h, lp[name]), with the layer's LoRA delta when it has one (jspec.lora.pool: the
    weight then carries the pool's columns)."""
    if "lora" in lp:
        out = lora_dense(*lp["lora"], h, lp[name], projection)
        return out[:, None, :] if out.ndim == 2 else out
    return _project(h, lp[name])


def _linear_lora(lp, x: jax.Array, name: str, projection: str) -> jax.Array:
    """x @ lp[name], with the layer's LoRA delta when it has one."""
    if "lora" in lp:
        return lora_dense(*lp["lora"], x, lp[name], projection).astype(x.dtype)
    return _linear(x, lp[name])


def paged_attend(cfg: ModelConfig, mode: AttentionMode, batch: ForwardBatch, layer, mask=None):
    """attend(q, k, v, (k_cache, v_cache)) for the paged pool: write the new K/V, then attend."""

    def attend(q, k, v, caches):
        k_cache = write_kv(caches[0], layer, batch.slots, k)
        v_cache = write_kv(caches[1], layer, batch.slots, v)
        out = paged_attention(
            q, k_cache, v_cache, layer, batch, mode, sm_scale=1.0 / math.sqrt(cfg.head_dim), mask=mask
        )
        return out, (k_cache, v_cache)

    return attend


def decoder_layer(cfg: ModelConfig, lp, x, h, cos, sin, attend, caches):
    """One pre-norm decoder layer on residual x whose attention input is h (already normed).

    The target passes h = RMSNorm(x); EAGLE draft layers pass other inputs
    (EAGLE-3 concatenates normed embeddings and normed hidden states).
    """
    q, k, v = qkv_heads(cfg, lp, h, cos, sin)
    attn, caches = attend(q, k, v, caches)
    x = x + _linear_lora(lp, attn.reshape(x.shape[0], cfg.q_size), "wo", "o")
    return mlp_block(cfg, lp, x), caches


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array):
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None]
    return jnp.cos(angles), jnp.sin(angles)


def compute_logits(params, cfg: ModelConfig, hidden_normed: jax.Array) -> jax.Array:
    return lm_head_logits(params, hidden_normed)


def lm_head_logits(params, h: jax.Array) -> jax.Array:
    """h [T, H] -> f32 logits [T, V] from params' lm_head [H, V], or the tied embedding [V, H].

    The tied case contracts the embedding's own axis: written as h @ embed.T, XLA:CPU
    materialises the transposed table on every call."""
    if "lm_head" in params:
        return dense_f32(h, params["lm_head"])
    return jax.lax.dot_general(h, params["embed"], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def run_layers(layers, body, carry):
    """carry = body(carry, lp, layer) for every layer, in order.

    layers is a dict of arrays stacked on a leading layer axis, run as one lax.scan (the
    layer body compiles once, whatever the depth), or a list of per-layer dicts, run as an
    unrolled loop (each layer compiled on its own, no weight ever sliced out of a stack).
    layer is the traced layer index under the scan, a Python int when unrolled.
    """
    if isinstance(layers, (list, tuple)):
        for i, lp in enumerate(layers):
            carry = body(carry, lp, i)
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


def forward(
    params,
    cfg: ModelConfig,
    kv: KVPool,
    batch: ForwardBatch,
    mode: AttentionMode,
    capture_layers: tuple[int, ...] = (),
    mask: jax.Array | None = None,
    lora: LoraBatch | None = None,
) -> tuple[KVPool, ForwardOutput]:
    """One forward pass over a ragged batch; returns the updated pool and the outputs.

    params["layers"] is stacked (scanned) or per-layer (unrolled): see run_layers.
    mask [B, max_q_len, max_q_len] replaces causal masking among each sequence's new tokens
    (tree verification). lora: the adapter pool and each token's slot (None: no LoRA, the
    programs are those without it); its layers are laid out as the model's.
    A DeepSeek config runs models/deepseek.py's forward (latent attention), which has no LoRA.
    """
    if cfg.deepseek is not None:
        from jspec.models.deepseek import forward as deepseek_forward

        if lora is not None:
            raise ValueError("LoRA adapters are not supported for DeepSeek (MLA) models")
        return deepseek_forward(params, cfg, kv, batch, mode, capture_layers, mask)
    dtype = params["embed"].dtype
    x = params["embed"][batch.tokens].astype(dtype)
    T = x.shape[0]
    cos, sin = rope_cos_sin(cfg, batch.positions)
    captured = jnp.zeros((len(capture_layers), T, cfg.hidden_size), dtype) if capture_layers else None
    lmask = slot_mask(lora.weights, lora.token_slots) if lora is not None else None
    layers = params["layers"]
    if lora is not None:  # each layer's pool arrays travel with its weights
        layers = attach_lora(layers, lora.weights.layers)

    def layer_body(carry, lp, layer):
        x, k_cache, v_cache, captured = carry
        if lora is not None:
            lp = {**lp, "lora": (lp["lora"], lmask)}
        captured = store_capture(captured, capture_layers, layer, x)
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        attend = paged_attend(cfg, mode, batch, jnp.int32(layer) if isinstance(layer, int) else layer, mask)
        x, (k_cache, v_cache) = decoder_layer(cfg, lp, x, h, cos, sin, attend, (k_cache, v_cache))
        return x, k_cache, v_cache, captured

    x, k_cache, v_cache, captured = run_layers(layers, layer_body, (x, kv.k, kv.v, captured))
    captured = store_capture(captured, capture_layers, cfg.num_layers, x)
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = compute_logits(params, cfg, h[batch.logits_indices])
    return KVPool(k_cache, v_cache), ForwardOutput(logits, h, captured)


def attach_lora(layers, lora_layers):
    """The model's layers with each one's LoRA pool arrays under "lora" (the pool is laid out
    as the layers are: stacked, or one dict per layer)."""
    if isinstance(layers, (list, tuple)):
        return [{**lp, "lora": lw} for lp, lw in zip(layers, lora_layers)]
    return {**layers, "lora": lora_layers}


def unstack_layers(params):
    """Stacked layer weights -> a list of per-layer dicts (leaf by leaf, freeing as it goes)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = len(next(iter(layers.values())))
    per_layer = [dict() for _ in range(n)]
    for name in list(layers):
        stacked = layers[name]
        for i in range(n):
            per_layer[i][name] = stacked[i]
    return {**params, "layers": per_layer}


def dense_forward(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """No-cache full-sequence forward for one sequence: the test oracle for the paged path.

    tokens: [T] -> logits [T, V] float32. Causal attention recomputed from scratch.
    """
    T = tokens.shape[0]
    x = params["embed"][tokens]
    cos, sin = rope_cos_sin(cfg, jnp.arange(T))
    group = cfg.num_heads // cfg.num_kv_heads
    causal = jnp.tril(jnp.ones((T, T), bool))

    def attend(q, k, v, caches):
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
        s = jnp.where(causal[None], s / math.sqrt(cfg.head_dim), -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32)).astype(q.dtype), caches

    def body(x, lp, layer):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        return decoder_layer(cfg, lp, x, h, cos, sin, attend, ())[0]

    x = run_layers(params["layers"], body, x)
    return compute_logits(params, cfg, rms_norm(x, params["final_norm"], cfg.rms_norm_eps))

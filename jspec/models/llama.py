"""Pure-functional Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and their MoE
kin Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss: see moe.py) over paged KV.

`forward` runs one ragged token batch (layers/batch.py) through all layers,
writes the new tokens' K/V into the pool, and returns logits only for the rows
asked for, plus the residual stream entering chosen layers (EAGLE-3 drafts
read three of them). Layers are stacked on a leading axis and run under
lax.scan, so compile time does not grow with depth (models/common.py: run_layers).
Callers run models/forward.py's forward, which picks this family or DeepSeek's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config.model import ModelConfig
from jspec.distributed.dp_attention import in_rank_region
from jspec.distributed.mesh import DATA
from jspec.kernels.backend import one_gpu
from jspec.kernels.paged_tiles import NO_WINDOW
from jspec.kernels.rope_kv import rope_kv_write
from jspec.kvcache.pool import KVPool, is_fp8_cache, write_kv
from jspec.layers.attention import paged_attention, rope_kv_backend
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.lora import LoraBatch, add_lora_delta, lora_dense, slot_mask
from jspec.layers.matmul import dense_f32
from jspec.layers.norm import add_rms_norm, rms_norm
from jspec.layers.quant import is_fp8
from jspec.models import rope
from jspec.models.common import ForwardOutput, compute_logits, run_layers, store_capture
from jspec.models.moe import moe_mlp_on_mesh
from jspec.models.rope import apply_rope


def _project(h: jax.Array, w: jax.Array) -> jax.Array:
    """h [T, in] @ w -> f32 [T, shards, n]; w is [in, n] (one shard) or [in, tp, n / tp]."""
    if w.ndim == 2:
        return dense_f32(h, w)[:, None, :]
    if is_fp8(w):
        return dense_f32(h, w)
    return jnp.einsum("ti,isn->tsn", h, w, preferred_element_type=jnp.float32)


def qkv_projection(cfg: ModelConfig, lp, h: jax.Array) -> jax.Array:
    """The QKV projection of normed input h [T, in], bias included: float32 [T, shards, n].
    wqkv is [in, n], or the tensor-parallel layout [in, tp, n / tp] (jspec.distributed): q, k, v
    of each shard's heads side by side, so qkv_heads' split stays within a shard. With LoRA wqkv
    carries the pool's columns (jspec.lora.pool)."""
    qkv = _project_lora(lp, h, "wqkv", "qkv")
    if cfg.qkv_bias:
        qkv = qkv + lp["bqkv"].reshape(qkv.shape[1], -1).astype(jnp.float32)
    return qkv


def qkv_heads(cfg: ModelConfig, lp, qkv: jax.Array, cos, sin, dtype):
    """The projection's output qkv [T, shards, n] as RoPE'd q [T, Hq, D], k and v [T, Hkv, D]
    in dtype (the activations')."""
    T, shards = qkv.shape[:2]
    qkv = qkv.astype(dtype)
    ql, kvl = cfg.q_size // shards, cfg.kv_size // shards
    q, k = qkv[..., :ql].reshape(T, cfg.q_size), qkv[..., ql : ql + kvl].reshape(T, cfg.kv_size)
    if cfg.qk_norm_whole:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = q.reshape(T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = qkv[..., ql + kvl :].reshape(T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def activation(cfg: ModelConfig):
    """The MLP gate's activation: SiLU (SwiGLU), or GELU's tanh form (GeGLU, Gemma)."""
    if cfg.hidden_act == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


def attention_input(cfg: ModelConfig, lp, x: jax.Array) -> jax.Array:
    """What a layer's attention reads of residual x: RMSNorm(x), or x itself where the norms
    sit on the sublayers' outputs only (OLMo 2)."""
    return x if cfg.norm_layout == "post" else rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)


def residual_delta(cfg: ModelConfig, lp, y: jax.Array, post_norm: str, dtype) -> jax.Array:
    """What a sublayer's output y adds to the residual stream: y normed first under the sandwich
    and post layouts (lp[post_norm]), scaled by Granite's residual multiplier. y may come wider
    than the stream's dtype (a projection's float32): rounded first where anything is done to
    it, else passed on in float32 for the add to round (add_rms_norm: in its
    kernel, where XLA would spend a kernel on the rounding alone)."""
    if passes_delta_unrounded(cfg):
        return y.astype(jnp.float32)
    y = y.astype(dtype)
    if cfg.norm_layout != "pre":
        y = rms_norm(y, lp[post_norm], cfg.rms_norm_eps)
    if cfg.residual_multiplier != 1.0:
        y = y * cfg.residual_multiplier
    return y


def passes_delta_unrounded(cfg: ModelConfig) -> bool:
    """Whether residual_delta passes a sublayer's output on as it is (float32): nothing is done
    to it before the add."""
    return cfg.norm_layout == "pre" and cfg.residual_multiplier == 1.0


def delta_dtype(cfg: ModelConfig, dtype):
    """The dtype of residual_delta's result for a stream of dtype."""
    return jnp.float32 if passes_delta_unrounded(cfg) else dtype


def add_and_norm(cfg: ModelConfig, x: jax.Array, delta: jax.Array, norm: jax.Array | None, backend: str | None):
    """(x + delta, the next sublayer's input): the sum's RMSNorm, or the sum itself where the
    norms sit on the sublayers' outputs only (OLMo 2). One kernel on the GPU (layers/norm.py),
    of the attention backend's family."""
    if cfg.norm_layout == "post":
        s = x + delta.astype(x.dtype)
        return s, s
    return add_rms_norm(x, delta, norm, cfg.rms_norm_eps, backend)


def embed_tokens(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The embedding rows of tokens, times the family's multiplier (Gemma's sqrt(hidden),
    rounded to the weights' dtype as HF does; Granite's embedding_multiplier)."""
    x = params["embed"][tokens]
    if cfg.embedding_multiplier != 1.0:
        x = x * jnp.asarray(cfg.embedding_multiplier, x.dtype)
    return x


def mlp_delta(cfg: ModelConfig, lp, x: jax.Array, h: jax.Array) -> jax.Array:
    """What the MLP adds to residual x, given its input h (x's RMSNorm, or x under the post
    layout): SwiGLU (GeGLU) of h, or MoE of h on a sparse layer (residual_delta's form)."""
    if "router" in lp:
        # The loader gives router and expert weights exactly to cfg.moe_layers (and a scan
        # stacks only alike layers), so the weights present say which block this layer is.
        return residual_delta(cfg, lp, moe_mlp_on_mesh(cfg, lp, h), "mlp_post_norm", x.dtype)
    if lp["w_gate_up"].ndim == 4:  # [in, 1, tp/dp, n]: this DP-attention rank's slice, for every rank's tokens
        return residual_delta(
            cfg, lp, dense_mlp_over_ranks(lp, h, activation(cfg)).astype(x.dtype), "mlp_post_norm", x.dtype
        )
    # [in, 2I], or [in, tp, 2I / tp] (as wqkv); with LoRA, w_gate_up carries the pool's columns
    gate_up = _project_lora(lp, h, "w_gate_up", "gate_up")
    half = gate_up.shape[-1] // 2
    T = x.shape[0]
    gate, up = gate_up[..., :half].reshape(T, -1), gate_up[..., half:].reshape(T, -1)
    y = _linear_lora_f32(lp, (activation(cfg)(gate) * up).astype(x.dtype), "w_down", "down")
    return residual_delta(cfg, lp, y, "mlp_post_norm", x.dtype)


def dense_mlp_over_ranks(lp, h: jax.Array, act_fn=jax.nn.silu) -> jax.Array:
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
    act = act_fn(gate_up[..., :half].reshape(T, -1)) * gate_up[..., half:].reshape(T, -1)
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


def _linear_lora_f32(lp, x: jax.Array, name: str, projection: str) -> jax.Array:
    """x @ lp[name] in float32, with the layer's LoRA delta when it has one."""
    if "lora" in lp:
        return lora_dense(*lp["lora"], x, lp[name], projection)
    return dense_f32(x, lp[name])


def layer_window(cfg: ModelConfig, layer) -> jax.Array | None:
    """The sliding window of layer (a traced index under the scan) as an int32 (), or None when
    no layer has one. Windowless layers of a mixed model get one wider than any context."""
    if not cfg.sliding_windows:
        return None
    windows = np.asarray([w or NO_WINDOW for w in cfg.sliding_windows], np.int32)
    if isinstance(layer, int):
        return jnp.int32(windows[layer])
    return jnp.asarray(windows)[layer]


def rope_kv_runs(
    cfg: ModelConfig, attention_backend: str, *, shards: int, fp8_pool: bool, norms_in_dtype: bool
) -> bool:
    """Whether a layer's RoPE and K / V write run as the one kernel (kernels/rope_kv.py): on one
    GPU under the Triton-backend attention, for one shard's full-rotary heads of a width Triton
    tiles (a power of two), into a 16-bit or float32 pool, with no norm on q and k or a per-head
    one whose weights are in the activations' dtype."""
    return (
        rope_kv_backend() == "pallas"
        and one_gpu()
        and attention_backend == "pallas"
        and shards == 1
        and not cfg.qk_norm_whole
        and norms_in_dtype
        and cfg.rotary_dim == cfg.head_dim
        and cfg.head_dim & (cfg.head_dim - 1) == 0
        and not fp8_pool
    )


@dataclasses.dataclass(frozen=True)
class PagedAttend:
    """attend(q, k, v, caches) for the paged pool: write the new K/V, then attend. sinks: the
    layer's attention sink logits [Hq] (gpt-oss), None for none.

    An FP8 pool holds K / k_scale and V / v_scale (kv_scale [2], this layer's; None: 1). The
    kernels read it as stored, so k_scale multiplies q (q.(k s) = (q s).k) and v_scale the output.

    Where rotates_and_writes holds, decoder_layer_deferred hands over the QKV projection's
    output instead (rope_and_attend): one kernel rotates q and k and writes k and v
    (kernels/rope_kv.py), where XLA would spend four.
    """

    cfg: ModelConfig
    mode: AttentionMode
    batch: ForwardBatch
    layer: jax.Array
    mask: jax.Array | None = None
    window: jax.Array | None = None
    kv_scale: jax.Array | None = None
    sinks: jax.Array | None = None

    def __call__(self, q, k, v, caches):
        fp8 = is_fp8_cache(caches[0]) and self.kv_scale is not None
        if fp8:
            k, v = k.astype(jnp.float32) / self.kv_scale[0], v.astype(jnp.float32) / self.kv_scale[1]
        caches = (
            write_kv(caches[0], self.layer, self.batch.slots, k),
            write_kv(caches[1], self.layer, self.batch.slots, v),
        )
        return self.read(q, caches)

    def read(self, q, caches):
        """Attention of q over the pool, whose leaves already hold the new tokens' K / V."""
        fp8 = is_fp8_cache(caches[0]) and self.kv_scale is not None
        qs = (q.astype(jnp.float32) * self.kv_scale[0]).astype(q.dtype) if fp8 else q
        out = paged_attention(
            qs,
            caches[0],
            caches[1],
            self.layer,
            self.batch,
            self.mode,
            sm_scale=self.cfg.sm_scale,
            mask=self.mask,
            window=self.window,
            logit_softcap=self.cfg.attn_logit_softcap,
            sinks=self.sinks,
        )
        if fp8:
            out = (out.astype(jnp.float32) * self.kv_scale[1]).astype(q.dtype)
        return out, caches

    def rotates_and_writes(self, qkv: jax.Array, caches, norms, dtype) -> bool:
        """Whether rope_and_attend runs for this projection output qkv [T, shards, n] (norms:
        the per-head q / k norm weights, or None): rope_kv_runs says."""
        return rope_kv_runs(
            self.cfg,
            self.mode.backend,
            shards=qkv.shape[1],
            fp8_pool=is_fp8_cache(caches[0]),
            norms_in_dtype=norms is None or all(w.dtype == dtype for w in norms),
        )

    def rope_and_attend(self, qkv: jax.Array, cos, sin, caches, norms, dtype):
        """attend(*qkv's heads rotated, caches) from the projection's output qkv [T, 1, n]:
        q and k normed (norms: their per-head weights, or None) and rotated, and k and v
        written, by one kernel, rounded to dtype as qkv_heads does."""
        cfg = self.cfg
        q, k_cache, v_cache = rope_kv_write(
            qkv[:, 0],
            cos,
            sin,
            caches[0],
            caches[1],
            self.layer,
            self.batch.slots,
            norms,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            dtype=dtype,
            eps=cfg.rms_norm_eps,
        )
        return self.read(q, (k_cache, v_cache))


def decoder_layer(cfg: ModelConfig, lp, x, h, cos, sin, attend, caches):
    """One decoder layer on residual x whose attention input is h.

    The target passes h = attention_input(x); EAGLE draft layers pass other inputs
    (EAGLE-3 concatenates normed embeddings and normed hidden states).
    """
    x, delta, caches = decoder_layer_deferred(cfg, lp, x, h, cos, sin, attend, caches)
    return x + delta.astype(x.dtype), caches


def decoder_layer_deferred(cfg: ModelConfig, lp, x, h, cos, sin, attend, caches):
    """decoder_layer without its last residual add: (x after attention, the MLP's delta,
    caches). The target's forward adds the delta together with the next layer's norm, one
    kernel on the GPU where the add and the norm would be three (layers/norm.py)."""
    qkv = qkv_projection(cfg, lp, h)
    norms = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm else None
    paged = isinstance(attend, PagedAttend)
    backend = attend.mode.backend if paged else None
    if paged and attend.rotates_and_writes(qkv, caches, norms, h.dtype):
        attn, caches = attend.rope_and_attend(qkv, cos, sin, caches, norms, h.dtype)
    else:
        attn, caches = attend(*qkv_heads(cfg, lp, qkv, cos, sin, h.dtype), caches)
    y = _linear_lora_f32(lp, attn.reshape(x.shape[0], cfg.q_size), "wo", "o")
    if cfg.o_bias:
        y = y.astype(x.dtype) + lp["bo"].astype(x.dtype)
    x, h = add_and_norm(cfg, x, residual_delta(cfg, lp, y, "attn_post_norm", x.dtype), lp.get("mlp_norm"), backend)
    return x, mlp_delta(cfg, lp, x, h), caches


def layer_rope(cfg: ModelConfig, layer, full, sliding):
    """The (cos, sin) of layer: sliding's on a sliding-window layer when the model rotates
    those with their own base (Gemma 3), else full's; the identity (cos 1, sin 0) on SmolLM3's
    NoPE layers. Selects under the scan."""
    cos, sin = full
    if sliding is not None:
        if isinstance(layer, int):
            cos, sin = sliding if cfg.sliding_windows[layer] else full
        else:
            is_sliding = jnp.asarray([w > 0 for w in cfg.sliding_windows])[layer]
            cos, sin = (jnp.where(is_sliding, s, f) for s, f in zip(sliding, full))
    if cfg.rope_layers:
        rotates = cfg.rope_layers[layer] if isinstance(layer, int) else jnp.asarray(cfg.rope_layers)[layer]
        cos, sin = jnp.where(rotates, cos, 1.0), jnp.where(rotates, sin, 0.0)
    return cos, sin


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, sliding: bool = False):
    """cos, sin [T, rotary_dim / 2] for positions [T] (models/rope.py); sliding: those of the
    sliding-window layers when the model rotates them with their own base."""
    return rope.cos_sin(cfg, positions, sliding and cfg.sliding_rope_theta is not None)


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
    """
    dtype = params["embed"].dtype
    x = embed_tokens(params, cfg, batch.tokens).astype(dtype)
    T = x.shape[0]
    cos, sin = rope_cos_sin(cfg, batch.positions)
    sliding_rope = rope_cos_sin(cfg, batch.positions, sliding=True) if cfg.sliding_rope_theta is not None else None
    captured = jnp.zeros((len(capture_layers), T, cfg.hidden_size), dtype) if capture_layers else None
    lmask = slot_mask(lora.weights, lora.token_slots) if lora is not None else None
    layers = params["layers"]
    kv_scales = params.get("kv_scale") if is_fp8_cache(kv.k) else None  # [L, 2], from the checkpoint
    if lora is not None:  # each layer's pool arrays travel with its weights
        layers = attach_lora(layers, lora.weights.layers)

    # Each layer's MLP delta is added by the next layer together with its norm (add_and_norm);
    # the first adds zeros. Not inside DP attention's per-rank region, where a MoE layer's delta
    # varies over the ranks and the residual does not: there each layer adds its own.
    defer = not in_rank_region()

    def layer_body(carry, lp, layer):
        x, delta, k_cache, v_cache, captured = carry
        if lora is not None:
            lp = {**lp, "lora": (lp["lora"], lmask)}
        x, h = (
            add_and_norm(cfg, x, delta, lp.get("attn_norm"), mode.backend)
            if defer
            else (x, attention_input(cfg, lp, x))
        )
        captured = store_capture(captured, capture_layers, layer, x)
        window = layer_window(cfg, layer)
        kv_scale = None if kv_scales is None else kv_scales[layer]
        layer_index = jnp.int32(layer) if isinstance(layer, int) else layer
        attend = PagedAttend(cfg, mode, batch, layer_index, mask, window, kv_scale, lp.get("sinks"))
        layer_cos, layer_sin = layer_rope(cfg, layer, (cos, sin), sliding_rope)
        x, mlp, (k_cache, v_cache) = decoder_layer_deferred(
            cfg, lp, x, h, layer_cos, layer_sin, attend, (k_cache, v_cache)
        )
        if not defer:
            return x + mlp.astype(x.dtype), delta, k_cache, v_cache, captured
        return x, mlp, k_cache, v_cache, captured

    x, delta, k_cache, v_cache, captured = run_layers(
        layers, layer_body, (x, jnp.zeros(x.shape, delta_dtype(cfg, x.dtype)), kv.k, kv.v, captured)
    )
    x, h = add_rms_norm(x, delta, params["final_norm"], cfg.rms_norm_eps, mode.backend)
    captured = store_capture(captured, capture_layers, cfg.num_layers, x)
    logits = compute_logits(params, cfg, h[batch.logits_indices])
    return KVPool(k_cache, v_cache), ForwardOutput(logits, h, captured)


def attach_lora(layers, lora_layers):
    """The model's layers with each one's LoRA pool arrays under "lora" (the pool is laid out
    as the layers are: stacked, or one dict per layer)."""
    if isinstance(layers, (list, tuple)):
        return [{**lp, "lora": lw} for lp, lw in zip(layers, lora_layers)]
    return type(layers)({**layers, "lora": lora_layers})  # an UnrolledStack stays one


def dense_forward(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """No-cache full-sequence forward for one sequence: the test oracle for the paged path.

    tokens: [T] -> logits [T, V] float32. Causal attention recomputed from scratch.
    """
    T = tokens.shape[0]
    x = embed_tokens(params, cfg, tokens)
    cos, sin = rope_cos_sin(cfg, jnp.arange(T))
    sliding_rope = rope_cos_sin(cfg, jnp.arange(T), sliding=True) if cfg.sliding_rope_theta is not None else None
    group = cfg.num_heads // cfg.num_kv_heads
    causal = jnp.tril(jnp.ones((T, T), bool))

    distance = jnp.arange(T)[:, None] - jnp.arange(T)[None, :]

    def attend_within(window, sinks):
        def attend(q, k, v, caches):
            k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
            s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * cfg.sm_scale
            if cfg.attn_logit_softcap is not None:
                s = cfg.attn_logit_softcap * jnp.tanh(s / cfg.attn_logit_softcap)
            visible = causal if window is None else causal & (distance < window)
            s = jnp.where(visible[None], s, -jnp.inf)
            if sinks is None:
                p = jax.nn.softmax(s, axis=-1)
            else:  # a sink is one more logit in each row's softmax, with nothing to weigh
                sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (*s.shape[:2], 1))
                p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
            return jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32)).astype(q.dtype), caches

        return attend

    def body(x, lp, layer):
        layer_cos, layer_sin = layer_rope(cfg, layer, (cos, sin), sliding_rope)
        attend = attend_within(layer_window(cfg, layer), lp.get("sinks"))
        return decoder_layer(cfg, lp, x, attention_input(cfg, lp, x), layer_cos, layer_sin, attend, ())[0]

    x = run_layers(params["layers"], body, x)
    return compute_logits(params, cfg, rms_norm(x, params["final_norm"], cfg.rms_norm_eps))

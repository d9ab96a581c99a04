"""Multi-token-prediction (MTP) layers: the draft of NEXTN (speculative/nextn.py).

An MTP layer reads, at position t, the embedding of x_{t+1} and the target's hidden state at t,
fuses them as eh_proj([enorm(embedding) | hnorm(hidden)]), runs one decoder layer of the
target's own kind, and norms the result, which both its logits (through the target's lm_head)
and its next draft step read. DeepSeek-V3's layer is an MLA + MoE layer; MiMo's a Qwen2 layer
(the loader puts its [hidden | embedding] projection into this order), and MiMo zeroes the
embedding at position 0.
"""

from __future__ import annotations

import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.layers.matmul import dense_f32
from jspec.layers.norm import rms_norm
from jspec.models.forward import decoder_layer


def mtp_layer(cfg: ModelConfig, mp, embed, tokens, positions, hidden, cos, sin, attend, caches):
    """-> (the layer's normed output [T, H], caches). attend: the decoder layer's attention
    closure (deepseek.paged_mla_attend / absorbed_attend, or llama.PagedAttend / a beams one)."""
    eps = cfg.rms_norm_eps
    e = embed[tokens].astype(hidden.dtype)
    if cfg.deepseek is None:
        e = jnp.where((positions == 0)[:, None], 0, e)
    fused = jnp.concatenate([rms_norm(e, mp["enorm"], eps), rms_norm(hidden, mp["hnorm"], eps)], axis=-1)
    x = dense_f32(fused, mp["eh_proj"]).astype(hidden.dtype)
    h = rms_norm(x, mp["attn_norm"], eps)
    x, caches = decoder_layer(cfg)(cfg, mp, x, h, cos, sin, attend, caches)
    return rms_norm(x, mp["head_norm"], eps), caches

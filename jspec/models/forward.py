"""The one place that picks a decoder family's code: models/llama.py for the Llama family
(every ModelConfig without `deepseek`), models/deepseek.py for DeepSeek-V3 / V2 (latent
attention). Steps and drafts call these, never a family's module directly."""

from __future__ import annotations

import jax

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import KVPool
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.lora import LoraBatch
from jspec.models import deepseek, llama
from jspec.models.common import ForwardOutput


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
    """One forward pass over a ragged batch (llama.forward's contract): the updated pool and
    the outputs. DeepSeek's forward has no LoRA."""
    if cfg.deepseek is None:
        return llama.forward(params, cfg, kv, batch, mode, capture_layers, mask, lora)
    if lora is not None:
        raise ValueError("LoRA adapters are not supported for DeepSeek (MLA) models")
    return deepseek.forward(params, cfg, kv, batch, mode, capture_layers, mask)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array):
    """The family's RoPE cos, sin for positions [T] (of the full-attention layers)."""
    return (deepseek if cfg.deepseek is not None else llama).rope_cos_sin(cfg, positions)


def decoder_layer(cfg: ModelConfig):
    """The family's decoder layer: layer(cfg, lp, x, h, cos, sin, attend, caches) -> (x, caches)."""
    return deepseek.decoder_layer if cfg.deepseek is not None else llama.decoder_layer

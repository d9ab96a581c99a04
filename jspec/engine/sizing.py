"""How big an engine's KV pool is, and which parallel layouts a model allows."""

from __future__ import annotations

import jax

from jspec.config.engine import EngineConfig
from jspec.config.model import ModelConfig
from jspec.kvcache.pool import kv_bytes_per_page, kv_cache_dtype

DEFAULT_KV_BYTES = 256 * 2**20


def check_parallel(config: EngineConfig, cfg: ModelConfig) -> None:
    """SGLang's rules for tp / ep / dp, checked before anything is placed."""
    tp, ep, dp = config.tp_size, config.ep_size, config.dp_size
    if cfg.deepseek is not None and (tp > 1 or dp > 1):
        raise ValueError(
            f"{cfg.family}: tensor / expert parallelism and DP attention are not implemented for latent-attention "
            f"(MLA) models yet; run with tp_size=1, dp_size=1 (got {tp}, {dp})"
        )
    if cfg.deepseek is not None and config.kv_cache_dtype != "auto":
        raise ValueError(f"{cfg.family}: an FP8 KV cache is not supported for latent-attention (MLA) models yet")
    if cfg.deepseek is not None and (config.lora_paths or config.enable_lora):
        raise ValueError(f"{cfg.family}: LoRA adapters are not supported for latent-attention (MLA) models")
    if ep != 1 and not (cfg.is_moe and ep == tp):
        raise ValueError(
            f"ep_size={ep}: expert parallelism splits an MoE model's experts over its "
            f"tensor-parallel devices, so it must equal tp_size ({tp}) on an MoE model "
            f"(this one is {'MoE' if cfg.is_moe else 'dense'}); 1 otherwise"
        )
    if cfg.is_moe and tp > 1 and ep != tp:
        raise ValueError(
            f"an MoE model with tp_size={tp} needs ep_size={tp} (its experts are split whole over the "
            f"devices, not column-wise)"
        )
    if dp > 1 and not config.enable_dp_attention:
        raise ValueError(
            f"dp_size={dp} needs enable_dp_attention=True (--enable-dp-attention): jspec "
            f"implements data parallelism only as DP attention inside the tp_size devices, "
            f"not as replicated engines"
        )
    if config.enable_dp_attention and dp == 1:
        raise ValueError("enable_dp_attention needs dp_size > 1 (--dp-size)")
    if config.enable_dp_attention and tp % dp:
        raise ValueError(
            f"DP attention needs tp_size % dp_size == 0 (each of the dp_size={dp} attention "
            f"ranks gets tp_size / dp_size devices); got tp_size={tp}"
        )


def kv_pages(config: EngineConfig, cfg: ModelConfig, params, method, dtype) -> int:
    """Pages of one pool (one per DP rank), the scratch page included: max_total_tokens' worth;
    else, on an accelerator that reports its memory, half of what mem_fraction_static of it
    leaves after the weights (the other half for the steps' activations and XLA's scratch);
    else 256 MiB of KV. cfg: the model as laid out (its KV heads repeated under TP if fewer
    than the devices), method: the speculative method whose draft KV shares each page."""
    S = config.page_size
    kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)  # the target's pool; a draft's stays in dtype
    per_page = kv_bytes_per_page(cfg, S, kv_dtype) + (method.draft_kv_bytes_per_page(S, dtype) if method else 0)
    if config.max_total_tokens:
        return -(-config.max_total_tokens // S) + 1
    if config.mem_fraction_static:
        total = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
        if not total:
            raise ValueError("mem_fraction_static needs an accelerator that reports its memory; use max_total_tokens")
        dp = config.dp_size if config.enable_dp_attention else 1
        # Per device: 1/tp of the weights, and each page's KV heads split over a rank's tp / dp devices.
        weights = sum(x.nbytes for x in jax.tree.leaves(params)) / config.tp_size
        free = total * config.mem_fraction_static - weights
        return max(2, int(free // (2 * per_page / (config.tp_size // dp))))
    return max(2, DEFAULT_KV_BYTES // per_page)

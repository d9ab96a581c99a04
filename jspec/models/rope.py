"""Rotary position embeddings: the frequencies of every rope_type jspec reads, as HF computes them.

Frequencies that HF picks by sequence length (dynamic NTK, LongRoPE's long and short factors)
are picked per token here: a token at position p gets what HF gives it when the sequence
reaches p + 1 tokens one token at a time. That equals HF's generation from any prompt within
the original context; HF's prefill of a longer prompt rotates all of it with the prompt
length's frequencies instead (its own incremental decoding disagrees with that prefill too).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config.model import ModelConfig, RopeScaling


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.float64) / dim


def inv_freq(theta: float, dim: int, rs: RopeScaling | None, long: bool = False) -> np.ndarray:
    """Inverse frequencies [dim / 2] (float32) of a rotary dimension dim with base theta.

    For "dynamic" these are the unscaled ones (the per-token rescaling is in cos_sin); for
    "longrope" the short factors, or the long ones with long=True."""
    base = 1.0 / (theta ** _exponents(dim))
    kind = None if rs is None else rs.rope_type
    if kind in (None, "dynamic"):
        return base.astype(np.float32)
    if kind == "linear":
        return (base / rs.factor).astype(np.float32)
    if kind == "llama3":
        return _llama3(base, rs).astype(np.float32)
    if kind == "yarn":
        return _yarn(base, theta, dim, rs).astype(np.float32)
    if kind == "longrope":
        factors = np.asarray(rs.long_factor if long else rs.short_factor, np.float64)
        return (base / factors).astype(np.float32)
    raise ValueError(f"unknown rope_type {kind!r}")


def _llama3(inv: np.ndarray, rs: RopeScaling) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(inv: np.ndarray, theta: float, dim: int, rs: RopeScaling) -> np.ndarray:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those that turn more than beta_fast times kept, a linear
    ramp between."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return inv / rs.factor * (1 - keep) + inv * keep


def cos_sin(cfg: ModelConfig, positions: jax.Array, sliding: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, rotary_dim / 2] of positions [T] (scaled by the rope's attention factor).

    sliding: the frequencies of sliding-window layers, where the model gives them their own."""
    theta, rs = (cfg.sliding_rope_theta, cfg.sliding_rope_scaling) if sliding else (cfg.rope_theta, cfg.rope_scaling)
    dim = cfg.rotary_dim
    pos = positions.astype(jnp.float32)[:, None]
    kind = None if rs is None else rs.rope_type
    if kind == "dynamic":
        # NTK: the base grows with the sequence once it outgrows the original context.
        seq = jnp.maximum(positions + 1, rs.original_max_position_embeddings).astype(jnp.float32)
        grown = theta * ((rs.factor * seq / rs.original_max_position_embeddings) - (rs.factor - 1)) ** (dim / (dim - 2))
        freqs = 1.0 / grown[:, None] ** jnp.asarray(_exponents(dim), jnp.float32)[None]
    elif kind == "longrope":
        past = (positions >= rs.original_max_position_embeddings)[:, None]
        freqs = jnp.where(past, jnp.asarray(inv_freq(theta, dim, rs, long=True)), jnp.asarray(inv_freq(theta, dim, rs)))
    else:
        freqs = jnp.asarray(inv_freq(theta, dim, rs))[None]
    angles = pos * freqs
    scale = 1.0 if rs is None else rs.attention_factor
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, D]; cos/sin: [T, R/2] with R <= D. Half-split rotation (HF's rotate_half) of
    the first R dimensions; the rest pass through (partial rotary)."""
    x32 = x.astype(jnp.float32)
    rot = 2 * cos.shape[-1]
    x1, x2, rest = x32[..., : rot // 2], x32[..., rot // 2 : rot], x32[..., rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
    return out.astype(x.dtype)

"""Token sampling on the device, every row with its own parameters.

Rows with temperature 0 take the argmax, so greedy and sampled requests share
one batch and one compiled program. A sampled row draws with the Gumbel-max
trick from a key made of its request's seed and the position of the token
being sampled, so a seeded request gets the same tokens whatever else is in
the batch, and whichever step (or re-prefill after retraction) samples them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Columns of SamplingRows.params (penalties.py reads the last three).
TEMPERATURE, TOP_K, TOP_P, MIN_P, FREQUENCY, PRESENCE, REPETITION = range(7)
NUM_PARAMS = 7


class SamplingRows(NamedTuple):
    """Per-row sampling parameters, packed into two arrays (few leaves: cheap dispatch)."""

    params: jax.Array  # [B, 7] float32: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off),
    # frequency, presence (0 = off) and repetition (1 = off) penalties
    seeds: jax.Array  # [B] uint32


def sampling_rows(params_list, seeds, rows: int) -> SamplingRows:
    """Host side: numpy SamplingRows for `rows` rows from SamplingParams (padding rows are greedy)."""
    out = np.zeros((rows, NUM_PARAMS), np.float32)
    out[:, TOP_P] = 1.0
    out[:, REPETITION] = 1.0
    for i, p in enumerate(params_list):
        out[i] = (p.temperature, p.top_k, p.top_p, p.min_p, p.frequency_penalty, p.presence_penalty,
                  p.repetition_penalty)
    s = np.zeros(rows, np.uint32)
    s[: len(seeds)] = seeds
    return SamplingRows(out, s)


def filtered_logits(logits: jax.Array, params: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Temperature, top-k, top-p and min-p applied: (masked logits sorted descending [B, V],
    the vocabulary ids in that order [B, V]). Masked entries are -inf; the top token always stays."""
    t = params[:, TEMPERATURE]
    x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[:, None]
    order = jnp.argsort(-x, axis=-1)
    sx = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sx, axis=-1)
    rank = jnp.arange(x.shape[-1])[None, :]
    k = params[:, TOP_K].astype(jnp.int32)[:, None]
    keep = (k <= 0) | (rank < k)
    # top-p: keep a token while the mass of the tokens before it is below top_p.
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < params[:, TOP_P][:, None]
    keep &= probs >= params[:, MIN_P][:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    return jnp.where(keep, sx, -jnp.inf), order


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


# What a batch's sampling needs, chosen on the host from its requests' SamplingParams (a static
# argument of the steps): "greedy" = argmax only; "temperature" = Gumbel-max over the scaled logits;
# "filtered" adds the vocabulary sort that top-k / top-p / min-p need. A row gets the same token
# in every mode that covers it (the noise belongs to the token id, not to its sorted rank), so a
# seeded request's output does not depend on what it is batched with.
SAMPLING_MODES = ("greedy", "temperature", "filtered")


def sampling_mode(params_list) -> str:
    """The cheapest mode that samples every SamplingParams in params_list exactly."""
    sampled = [p for p in params_list if p.temperature > 0]
    if not sampled:
        return "greedy"
    if all(p.top_k <= 0 and p.top_p >= 1 and p.min_p <= 0 for p in sampled):
        return "temperature"
    return "filtered"


def sample_tokens(logits: jax.Array, rows: SamplingRows, positions: jax.Array, mode: str = "filtered") -> jax.Array:
    """logits [B, V]; positions [B]: the sequence position of the token being sampled -> [B] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(row_keys(rows.seeds, positions))
    t = rows.params[:, TEMPERATURE]
    if mode == "temperature":
        x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[:, None]
        sampled = jnp.argmax(x + gumbel, axis=-1).astype(jnp.int32)
    else:
        masked, order = filtered_logits(logits, rows.params)
        choice = jnp.argmax(masked + jnp.take_along_axis(gumbel, order, axis=-1), axis=-1)
        sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(t > 0, sampled, greedy)


def token_logprobs(logits: jax.Array, rows: SamplingRows, tokens: jax.Array, top_n: int):
    """Log-probabilities after the temperature transform (as SGLang reports them; a greedy row
    uses temperature 1): (logprob of tokens [R], top_n ids [R, top_n], their logprobs [R, top_n])."""
    t = rows.params[:, TEMPERATURE]
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[:, None], axis=-1)
    chosen = jnp.take_along_axis(lsm, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if top_n == 0:
        return chosen, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(lsm, top_n)
    return chosen, top_ids.astype(jnp.int32), top_lp

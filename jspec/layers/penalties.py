"""Frequency, presence and repetition penalties on the device, exact under speculation.

Per slot the device keeps each token's emitted count and whether the prompt holds it, so the
host never sends histories. Semantics as SGLang's; they act on the raw logits before
temperature and filters. Under speculation a tree node is penalised as if its path had been
emitted one token at a time: the slot's counts plus its drafted ancestors, re-applied per
node, so no [B, N, V] count tensor is built. A request's logit_bias rides along: up to
MAX_LOGIT_BIAS_TOKENS (token, value) pairs per slot, written when its prefill starts and added
to its logits after the penalties, every tree node's alike.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config.sampling import MAX_LOGIT_BIAS_TOKENS
from jspec.layers.sampling import FREQUENCY, PRESENCE, REPETITION


class PenaltyState(NamedTuple):
    output_counts: jax.Array  # [slots+1, V] int32: times each token was emitted
    prompt_seen: jax.Array  # [slots+1, V] bool: token occurs in the prompt
    # The request's logit_bias, sparse: tokens (V where none) and the values added to their logits.
    bias_tokens: jax.Array  # [slots+1, MAX_LOGIT_BIAS_TOKENS] int32
    bias_values: jax.Array  # [slots+1, MAX_LOGIT_BIAS_TOKENS] float32


class PrefillCounts(NamedTuple):
    """What a prefill chunk batch adds to the penalty state (see record_prefill)."""

    reset_slots: jax.Array  # [B] int32: slot of each row that starts its request, else the scratch slot
    token_slots: jax.Array  # [T] int32: slot of each token's request (scratch for padding)
    is_output: jax.Array  # [T] bool: the token was generated before (a re-prefill after retraction)
    bias_tokens: jax.Array  # [B, MAX_LOGIT_BIAS_TOKENS] int32: a starting row's logit_bias (V pads)
    bias_values: jax.Array  # [B, MAX_LOGIT_BIAS_TOKENS] float32


def init_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    rows = num_slots + 1
    return PenaltyState(
        jnp.zeros((rows, vocab_size), jnp.int32),
        jnp.zeros((rows, vocab_size), bool),
        jnp.full((rows, MAX_LOGIT_BIAS_TOKENS), vocab_size, jnp.int32),
        jnp.zeros((rows, MAX_LOGIT_BIAS_TOKENS), jnp.float32),
    )


def logit_bias_rows(biases, rows: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side: PrefillCounts' bias arrays for `rows` rows from each row's logit_bias (a
    {token: value} dict or None; rows past the list have none)."""
    tokens = np.full((rows, MAX_LOGIT_BIAS_TOKENS), vocab_size, np.int32)
    values = np.zeros((rows, MAX_LOGIT_BIAS_TOKENS), np.float32)
    for i, bias in enumerate(biases):
        if bias:
            tokens[i, : len(bias)] = list(bias)
            values[i, : len(bias)] = list(bias.values())
    return tokens, values


def add_logit_bias(x: jax.Array, state: PenaltyState, slot_ids: jax.Array) -> jax.Array:
    """x [B, V] (or [B, N, V]: every node of a row's tree) float32 logits of the rows in
    slot_ids [B], plus each row's logit_bias."""
    tokens, values = state.bias_tokens[slot_ids], state.bias_values[slot_ids]  # [B, K]
    rows = jnp.arange(x.shape[0])[:, None]
    if x.ndim == 3:
        N = x.shape[1]
        return x.at[rows[:, :, None], jnp.arange(N)[None, :, None], tokens[:, None, :]].add(
            jnp.broadcast_to(values[:, None, :], (x.shape[0], N, values.shape[1])), mode="drop"
        )
    return x.at[rows, tokens].add(values, mode="drop")


def _penalise(x, count, prompt_seen, params):
    """x: logits (f32), count: emission counts, prompt_seen: bool, params: [..., 7] broadcast to x."""
    rep = params[..., REPETITION]
    seen = (count > 0) | prompt_seen
    x = jnp.where(seen, jnp.where(x > 0, x / rep, x * rep), x)
    return x - params[..., FREQUENCY] * count - params[..., PRESENCE] * (count > 0)


def apply_penalties(logits: jax.Array, state: PenaltyState, slot_ids: jax.Array, params: jax.Array) -> jax.Array:
    """logits [B, V] of the rows in slot_ids [B], params [B, 7] -> penalised float32 logits."""
    x = _penalise(
        logits.astype(jnp.float32), state.output_counts[slot_ids], state.prompt_seen[slot_ids], params[:, None, :]
    )
    return add_logit_bias(x, state, slot_ids)


def apply_tree_penalties(
    node_logits: jax.Array,
    state: PenaltyState,
    slot_ids: jax.Array,
    params: jax.Array,
    tree_tokens: jax.Array,
    tree_mask: jax.Array,
) -> jax.Array:
    """node_logits [B, N, V]: the target's logits after each tree node; tree_tokens [B, N] (node 0 =
    root, already counted); tree_mask [B, N, N] (node i's ancestors and itself) -> penalised float32
    logits, node i's with the counts that emitting root..i one token at a time would have."""
    B, N, V = node_logits.shape
    counts = state.output_counts[slot_ids]  # [B, V]
    seen = state.prompt_seen[slot_ids]
    p = params[:, None, None, :]
    x = node_logits.astype(jnp.float32)
    out = _penalise(x, counts[:, None, :], seen[:, None, :], p)
    # Drafted ancestors of node i (root excluded) and the extra count each of their tokens gets.
    on_path = tree_mask & (jnp.arange(N) > 0)[None, None, :]  # [B, i, j]
    tok = tree_tokens[:, None, :]  # token of ancestor j, [B, 1, N]
    same = tree_tokens[:, :, None] == tree_tokens[:, None, :]  # [B, j, j']
    extra = jnp.einsum("bij,bjk->bik", on_path.astype(jnp.int32), same.astype(jnp.int32))  # [B, i, j]
    tok_b = jnp.broadcast_to(tok, (B, N, N))
    base = jnp.take_along_axis(counts, tree_tokens, axis=1)[:, None, :]  # [B, 1, N]
    raw = jnp.take_along_axis(x, tok_b, axis=2)  # [B, i, j]: node i's logit of ancestor j's token
    seen_j = jnp.take_along_axis(seen, tree_tokens, axis=1)[:, None, :]
    fixed = _penalise(raw, base + extra, seen_j, p)
    # Several ancestors with one token write the same value; off-path entries are dropped.
    col = jnp.where(on_path, tok_b, V)
    bi = jnp.arange(B)[:, None, None]
    ni = jnp.arange(N)[None, :, None]
    return add_logit_bias(out.at[bi, ni, col].set(fixed, mode="drop"), state, slot_ids)


def record_emitted(state: PenaltyState, slot_ids: jax.Array, tokens: jax.Array) -> PenaltyState:
    """Counts tokens [B, K] (entries < 0 are not emitted) for the rows in slot_ids [B]."""
    ok = tokens >= 0
    rows = jnp.broadcast_to(slot_ids[:, None], tokens.shape)
    counts = state.output_counts.at[rows, jnp.where(ok, tokens, 0)].add(ok.astype(jnp.int32))
    return state._replace(output_counts=counts)


def record_prefill(state: PenaltyState, tokens: jax.Array, pc: PrefillCounts) -> PenaltyState:
    """Starts the rows in pc.reset_slots afresh (a request's first chunk), then counts a prefill
    chunk batch's tokens [T] into their slots: prompt tokens as seen, already generated ones
    (a retracted request's re-prefill) as emitted."""
    counts = state.output_counts.at[pc.reset_slots].set(0)
    seen = state.prompt_seen.at[pc.reset_slots].set(False)
    counts = counts.at[pc.token_slots, tokens].add(pc.is_output.astype(jnp.int32))
    seen = seen.at[pc.token_slots, jnp.where(pc.is_output, seen.shape[1], tokens)].set(True, mode="drop")
    # A row that does not start its request writes the scratch slot: padding over padding.
    bias_tokens = state.bias_tokens.at[pc.reset_slots].set(pc.bias_tokens)
    bias_values = state.bias_values.at[pc.reset_slots].set(pc.bias_values)
    return PenaltyState(counts, seen, bias_tokens, bias_values)

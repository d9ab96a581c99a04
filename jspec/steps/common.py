"""What every step shares: its outputs (and their packing for the host), the carry's
per-slot gather, page-table slot arithmetic and the first-token sampling of a prefill."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.layers.batch import ForwardBatch
from jspec.layers.penalties import PenaltyState, PrefillCounts, apply_penalties, record_emitted, record_prefill
from jspec.layers.sampling import NUM_PARAMS, SamplingRows, apply_vocab_mask, sample_tokens, token_logprobs
from jspec.models.common import compute_logits


class PromptLogprobs(NamedTuple):
    """Per prefill token t: the log-probability of the token after it, under the raw target."""

    logprobs: jax.Array  # [T] float32
    top_ids: jax.Array  # [T, top_n] int32
    top_logprobs: jax.Array  # [T, top_n] float32


class StepOutput(NamedTuple):
    """What the host reads back from a step (the only device->host transfer)."""

    tokens: jax.Array  # [B, K] int32, emitted tokens of each row, -1 past accept_len + 1
    accept_len: jax.Array  # [B] int32, accepted draft tokens (0 without speculation): emits accept_len + 1
    logprobs: jax.Array  # [B, K] float32, each emitted token's logprob under the target
    top_ids: jax.Array  # [B, K, top_n] int32, the target's top_n alternatives at each emitted position
    top_logprobs: jax.Array  # [B, K, top_n] float32
    prompt: PromptLogprobs | None = None  # prefills asked for prompt logprobs only


class PackedOutput(NamedTuple):
    """A StepOutput in two arrays, so the host starts two device->host copies, not five: every
    array a launch hands over costs host time (the launch's budget is a fraction of a ms)."""

    ints: jax.Array  # [..., B, K + 1 + K * top_n]: tokens, accept_len, top_ids
    floats: jax.Array  # [..., B, K + K * top_n]: logprobs, top_logprobs
    prompt: PromptLogprobs | None = None


def pack_output(o: StepOutput) -> PackedOutput:
    B, K = o.tokens.shape
    ints = jnp.concatenate([o.tokens, o.accept_len[:, None], o.top_ids.reshape(B, -1)], axis=1)
    floats = jnp.concatenate([o.logprobs, o.top_logprobs.reshape(B, -1)], axis=1)
    return PackedOutput(ints, floats, o.prompt)


def unpack_output(p: PackedOutput, top_n: int) -> StepOutput:
    """The host's view (numpy, any leading axes) of a packed step output."""
    K = p.floats.shape[-1] // (1 + top_n)
    lead = p.ints.shape[:-1]
    return StepOutput(
        p.ints[..., :K],
        p.ints[..., K],
        p.floats[..., :K],
        p.ints[..., K + 1 :].reshape(*lead, K, top_n),
        p.floats[..., K:].reshape(*lead, K, top_n),
        p.prompt,
    )


def one_token_output(logits, rows: SamplingRows, tok, top_n: int) -> StepOutput:
    lp, ids, tlp = token_logprobs(logits, rows, tok, top_n)
    B = tok.shape[0]
    return StepOutput(tok[:, None], jnp.zeros(B, jnp.int32), lp[:, None], ids[:, None], tlp[:, None])


def prompt_logprobs(params, cfg: ModelConfig, hidden_normed, next_tokens, top_n: int) -> PromptLogprobs:
    """Logits at every prefill token (a [T, V] lm_head: only compiled into prefills that need it)
    and the logprob of the token after each; temperature 1, no penalties: the model's own score."""
    logits = compute_logits(params, cfg, hidden_normed)
    T = next_tokens.shape[0]
    lp, ids, tlp = token_logprobs(
        logits, SamplingRows(jnp.zeros((T, NUM_PARAMS), jnp.float32), jnp.zeros(T, jnp.uint32)), next_tokens, top_n
    )
    return PromptLogprobs(lp, ids, tlp)


def slots_of(page_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat KV slot of each position [B, X] through its row's page table [B, M]."""
    pidx = jnp.clip(positions // page_size, 0, page_tables.shape[1] - 1)
    return jnp.take_along_axis(page_tables, pidx, axis=1) * page_size + positions % page_size


def gather_slots(carry, slot_ids: jax.Array):
    """The carry rows of slot_ids, with padding rows (the scratch slot) reset to length 0."""
    c = jax.tree.map(lambda a: a[slot_ids], carry)
    scratch = carry.seq_len.shape[0] - 1
    return c._replace(seq_len=jnp.where(slot_ids == scratch, 0, c.seq_len))


def sample_first_tokens(
    logits,
    pen: PenaltyState,
    batch: ForwardBatch,
    slot_ids,
    counts: PrefillCounts,
    rows: SamplingRows,
    sampling: str,
    vocab_mask=None,
):
    """A prefill's sampled tokens (the first token sits at position seq_len), after the chunk's
    tokens are counted for penalties: (tokens [B], penalised logits [B, V], new PenaltyState)."""
    pen = record_prefill(pen, batch.tokens, counts)
    logits = apply_vocab_mask(apply_penalties(logits, pen, slot_ids, rows.params), vocab_mask)
    first = sample_tokens(logits, rows, batch.seq_lens, sampling)
    return first, logits, record_emitted(pen, slot_ids, first[:, None])

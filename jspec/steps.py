"""Plain (non-speculative) prefill and decode steps over donated device state.

The carry is the FutureMap: per request slot, the token that the next step
feeds (`next_token`, sampled by the previous step and never read by the host
before the next launch) and the KV length `seq_len`. A decode step reads both
from its slots, so the host can launch step N+1 before it has seen step N's
tokens. The last slot is scratch for padded batch rows.

Carry convention (shared with spec/eagle.py): the KV holds positions
0..seq_len-1; next_token is x_{seq_len}, not yet in the KV.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.lora import LoraBatch
from jspec.models.batch import AttentionMode, ForwardBatch
from jspec.models.llama import forward
from jspec.paged_kv.pool import KVPool
from jspec.penalties import PenaltyState, PrefillCounts, apply_penalties, record_emitted, record_prefill
from jspec.sampling import NUM_PARAMS, SamplingRows, sample_tokens, token_logprobs


class PlainCarry(NamedTuple):
    next_token: jax.Array  # [slots+1] int32
    seq_len: jax.Array  # [slots+1] int32


class PlainState(NamedTuple):
    target_kv: KVPool
    carry: PlainCarry
    penalties: PenaltyState


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
    return StepOutput(p.ints[..., :K], p.ints[..., K], p.floats[..., :K],
                      p.ints[..., K + 1 :].reshape(*lead, K, top_n), p.floats[..., K:].reshape(*lead, K, top_n),
                      p.prompt)


def one_token_output(logits, rows: SamplingRows, tok, top_n: int) -> StepOutput:
    lp, ids, tlp = token_logprobs(logits, rows, tok, top_n)
    B = tok.shape[0]
    return StepOutput(tok[:, None], jnp.zeros(B, jnp.int32), lp[:, None], ids[:, None], tlp[:, None])


def prompt_logprobs(params, cfg: ModelConfig, hidden_normed, next_tokens, top_n: int) -> PromptLogprobs:
    """Logits at every prefill token (a [T, V] lm_head: only compiled into prefills that need it)
    and the logprob of the token after each; temperature 1, no penalties: the model's own score."""
    from jspec.models.llama import compute_logits

    logits = compute_logits(params, cfg, hidden_normed)
    T = next_tokens.shape[0]
    lp, ids, tlp = token_logprobs(logits, SamplingRows(jnp.zeros((T, NUM_PARAMS), jnp.float32), jnp.zeros(T, jnp.uint32)),
                                  next_tokens, top_n)
    return PromptLogprobs(lp, ids, tlp)


def init_plain_carry(num_slots: int) -> PlainCarry:
    return PlainCarry(jnp.zeros(num_slots + 1, jnp.int32), jnp.zeros(num_slots + 1, jnp.int32))


def slots_of(page_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat KV slot of each position [B, X] through its row's page table [B, M]."""
    pidx = jnp.clip(positions // page_size, 0, page_tables.shape[1] - 1)
    return jnp.take_along_axis(page_tables, pidx, axis=1) * page_size + positions % page_size


def gather_slots(carry, slot_ids: jax.Array):
    """The carry rows of slot_ids, with padding rows (the scratch slot) reset to length 0."""
    c = jax.tree.map(lambda a: a[slot_ids], carry)
    scratch = carry.seq_len.shape[0] - 1
    return c._replace(seq_len=jnp.where(slot_ids == scratch, 0, c.seq_len))


@functools.partial(jax.jit, static_argnames=("cfg", "mode", "top_n", "with_prompt_logprobs", "sampling"),
                   donate_argnames=("state",))
def plain_prefill_step(params, state: PlainState, batch: ForwardBatch, next_tokens, slot_ids, counts: PrefillCounts,
                       rows: SamplingRows, lora: LoraBatch | None = None, *, cfg: ModelConfig, mode: AttentionMode,
                       top_n: int = 0, with_prompt_logprobs: bool = False, sampling: str = "sampled"):
    """Prefills one ragged chunk batch. slot_ids [B]: carry slot of each sequence whose prompt
    ends in this chunk (it receives the sampled first token), else the scratch slot.
    next_tokens [T]: the prompt token after each token (scored when with_prompt_logprobs).
    lora: the adapter pool and each token's adapter slot [T] (None: no LoRA)."""
    kv, out = forward(params, cfg, state.target_kv, batch, mode, lora=lora)
    first, logits, pen = sample_first_tokens(out.logits, state.penalties, batch, slot_ids, counts, rows, sampling)
    c = state.carry
    carry = PlainCarry(c.next_token.at[slot_ids].set(first, mode="drop"), c.seq_len.at[slot_ids].set(batch.seq_lens, mode="drop"))
    result = one_token_output(logits, rows, first, top_n)
    if with_prompt_logprobs:
        result = result._replace(prompt=prompt_logprobs(params, cfg, out.hidden, next_tokens, top_n))
    return PlainState(kv, carry, pen), pack_output(result)


def sample_first_tokens(logits, pen: PenaltyState, batch: ForwardBatch, slot_ids, counts: PrefillCounts,
                        rows: SamplingRows, sampling: str):
    """A prefill's sampled tokens (the first token sits at position seq_len), after the chunk's
    tokens are counted for penalties: (tokens [B], penalised logits [B, V], new PenaltyState)."""
    pen = record_prefill(pen, batch.tokens, counts)
    logits = apply_penalties(logits, pen, slot_ids, rows.params)
    first = sample_tokens(logits, rows, batch.seq_lens, sampling)
    return first, logits, record_emitted(pen, slot_ids, first[:, None])


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "top_n", "sampling"),
                   donate_argnames=("state",))
def plain_decode_step(params, state: PlainState, slot_ids, page_tables, rows: SamplingRows,
                      lora: LoraBatch | None = None, *, cfg: ModelConfig, backend: str = "pallas",
                      top_n: int = 0, sampling: str = "sampled"):
    """One token for each slot in slot_ids [B]; page_tables [B, M] cover position seq_len.
    lora: the adapter pool and each row's adapter slot [B] (None: no LoRA)."""
    B = slot_ids.shape[0]
    c = gather_slots(state.carry, slot_ids)
    n = c.seq_len
    page_size = state.target_kv.page_size
    batch = ForwardBatch(
        tokens=c.next_token,
        positions=n,
        slots=slots_of(page_tables, n[:, None], page_size)[:, 0],
        seq_lens=n + 1,
        page_tables=page_tables,
        query_start=jnp.arange(B + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(B, dtype=jnp.int32),
    )
    kv, out = forward(params, cfg, state.target_kv, batch, AttentionMode(True, 1, backend), lora=lora)
    logits = apply_penalties(out.logits, state.penalties, slot_ids, rows.params)
    tok = sample_tokens(logits, rows, n + 1, sampling)
    new = PlainCarry(tok, n + 1)
    carry = jax.tree.map(lambda full, part: full.at[slot_ids].set(part), state.carry, new)
    pen = record_emitted(state.penalties, slot_ids, tok[:, None])
    return PlainState(kv, carry, pen), pack_output(one_token_output(logits, rows, tok, top_n))

"""Plain (non-speculative) prefill and decode steps over donated device state.

The carry is the FutureMap: per request slot, the token that the next step
feeds (`next_token`, sampled by the previous step and never read by the host
before the next launch) and the KV length `seq_len`. A decode step reads both
from its slots, so the host can launch step N+1 before it has seen step N's
tokens. The last slot is scratch for padded batch rows.

Carry convention (shared with speculative/method.py's SpecCarry): the KV holds positions
0..seq_len-1; next_token is x_{seq_len}, not yet in the KV.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import KVPool
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.lora import LoraBatch
from jspec.layers.penalties import PenaltyState, PrefillCounts, apply_penalties, record_emitted
from jspec.layers.sampling import SamplingRows, apply_vocab_mask, sample_tokens
from jspec.models.forward import forward
from jspec.steps.common import (
    gather_slots,
    one_token_output,
    pack_output,
    prompt_logprobs,
    sample_first_tokens,
    slots_of,
)


class PlainCarry(NamedTuple):
    next_token: jax.Array  # [slots+1] int32
    seq_len: jax.Array  # [slots+1] int32


class PlainState(NamedTuple):
    target_kv: KVPool
    carry: PlainCarry
    penalties: PenaltyState


def init_plain_carry(num_slots: int) -> PlainCarry:
    return PlainCarry(jnp.zeros(num_slots + 1, jnp.int32), jnp.zeros(num_slots + 1, jnp.int32))


@functools.partial(
    jax.jit, static_argnames=("cfg", "mode", "top_n", "with_prompt_logprobs", "sampling"), donate_argnames=("state",)
)
def plain_prefill_step(
    params,
    state: PlainState,
    batch: ForwardBatch,
    next_tokens,
    slot_ids,
    counts: PrefillCounts,
    rows: SamplingRows,
    lora: LoraBatch | None = None,
    vocab_mask=None,
    carry_slots=None,
    *,
    cfg: ModelConfig,
    mode: AttentionMode,
    top_n: int = 0,
    with_prompt_logprobs: bool = False,
    sampling: str = "sampled",
):
    """Prefills one ragged chunk batch. slot_ids [B]: carry slot of each sequence whose prompt
    ends in this chunk (it receives the sampled first token), else the scratch slot.
    next_tokens [T]: the prompt token after each token (scored when with_prompt_logprobs).
    lora: the adapter pool and each token's adapter slot [T] (None: no LoRA).
    vocab_mask: [B, words] token bitmasks of the sequences (None: every token allowed).
    carry_slots: [T] the slot whose carried next token a token is, else -1: a running request's
    decode row, mixed into the prefill (its token was sampled by a step the host has not read)."""
    if carry_slots is not None:
        fed = carry_slots >= 0
        carried = state.carry.next_token[jnp.where(fed, carry_slots, 0)]
        batch = batch._replace(tokens=jnp.where(fed, carried, batch.tokens))
    kv, out = forward(params, cfg, state.target_kv, batch, mode, lora=lora)
    first, logits, pen = sample_first_tokens(
        out.logits, state.penalties, batch, slot_ids, counts, rows, sampling, vocab_mask
    )
    c = state.carry
    carry = PlainCarry(
        c.next_token.at[slot_ids].set(first, mode="drop"), c.seq_len.at[slot_ids].set(batch.seq_lens, mode="drop")
    )
    result = one_token_output(logits, rows, first, top_n)
    if with_prompt_logprobs:
        result = result._replace(prompt=prompt_logprobs(params, cfg, out.hidden, next_tokens, top_n))
    return PlainState(kv, carry, pen), pack_output(result)


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "top_n", "sampling"), donate_argnames=("state",))
def plain_decode_step(
    params,
    state: PlainState,
    slot_ids,
    page_tables,
    rows: SamplingRows,
    lora: LoraBatch | None = None,
    vocab_mask=None,
    *,
    cfg: ModelConfig,
    backend: str = "pallas",
    top_n: int = 0,
    sampling: str = "sampled",
):
    """One token for each slot in slot_ids [B]; page_tables [B, M] cover position seq_len.
    lora: the adapter pool and each row's adapter slot [B] (None: no LoRA).
    vocab_mask: [B, words] token bitmasks of the rows (None: every token allowed)."""
    kv, logits = _decode_forward(params, state, slot_ids, page_tables, rows, lora, cfg, backend)
    return _decode_sample(state._replace(target_kv=kv), logits, slot_ids, rows, vocab_mask, top_n, sampling)


# Structured outputs under the overlap loop split the decode in two dispatches: the forward
# is launched before the host knows the rows' masks (they follow from the previous step's
# tokens, read meanwhile), the sampling after.


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("state",))
def plain_decode_forward(params, state: PlainState, slot_ids, page_tables, rows, lora, *, cfg: ModelConfig, backend):
    """The decode's forward: -> (state with the new KV written, penalised logits [B, V])."""
    kv, logits = _decode_forward(params, state, slot_ids, page_tables, rows, lora, cfg, backend)
    return state._replace(target_kv=kv), logits


@functools.partial(jax.jit, static_argnames=("top_n", "sampling"), donate_argnames=("state",))
def plain_decode_sample(state: PlainState, logits, slot_ids, rows, vocab_mask, *, top_n: int, sampling: str):
    """The decode's sampling over plain_decode_forward's logits, masked by vocab_mask [B, words]."""
    return _decode_sample(state, logits, slot_ids, rows, vocab_mask, top_n, sampling)


def _decode_forward(params, state: PlainState, slot_ids, page_tables, rows, lora, cfg, backend):
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
    return kv, apply_penalties(out.logits, state.penalties, slot_ids, rows.params)


def _decode_sample(state: PlainState, logits, slot_ids, rows, vocab_mask, top_n, sampling):
    n = gather_slots(state.carry, slot_ids).seq_len
    logits = apply_vocab_mask(logits, vocab_mask)
    tok = sample_tokens(logits, rows, n + 1, sampling)
    new = PlainCarry(tok, n + 1)
    carry = jax.tree.map(lambda full, part: full.at[slot_ids].set(part), state.carry, new)
    pen = record_emitted(state.penalties, slot_ids, tok[:, None])
    return PlainState(state.target_kv, carry, pen), pack_output(one_token_output(logits, rows, tok, top_n))

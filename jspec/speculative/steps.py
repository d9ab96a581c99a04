"""The speculative prefill and decode steps over donated device state, for any SpecMethod
(speculative/method.py), as steps/plain.py's are for plain decoding.

A decode step is one iteration in one dispatch: the method proposes the verify tree from the
carry, the target verifies it (speculative/verify.py), and the method's draft state follows
the accepted tokens. Structured outputs split it in two dispatches (spec_propose_step, then
spec_verify_step): the host reads the proposed tree between them and masks every node by the
grammar state of its path (constrained/grammar.py: tree_masks).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from jspec.config.model import ModelConfig
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.lora import LoraBatch
from jspec.layers.penalties import PrefillCounts, record_emitted
from jspec.layers.sampling import SamplingRows
from jspec.models.forward import forward
from jspec.speculative.method import PrefillContext, SpecCarry, SpecMethod, SpecState
from jspec.speculative.tree import DraftTree
from jspec.speculative.verify import verify_tree
from jspec.steps.common import (
    PackedOutput,
    gather_slots,
    one_token_output,
    pack_output,
    prompt_logprobs,
    sample_first_tokens,
)


class VerifyBatch(NamedTuple):
    """What the verification of one iteration's trees reads besides the state."""

    tree: DraftTree  # the proposed trees, one per row
    slot_ids: jax.Array  # [B] each row's carry slot (padding rows: the scratch slot)
    page_tables: jax.Array  # [B, M]
    rows: SamplingRows
    lora: LoraBatch | None = None  # the adapter pool and each row's adapter slot [B]
    node_masks: jax.Array | None = None  # [B, N, words] the grammar's tokens after each node (None: all)
    drafting: jax.Array | None = None  # [B] bool: the rows that verify their tree (None: every row)


def _scatter_rows(full, part, slot_ids, mode=None):
    return jax.tree.map(lambda f, p: f.at[slot_ids].set(p.astype(f.dtype), mode=mode), full, part)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "method", "mode", "top_n", "with_prompt_logprobs", "sampling"),
    donate_argnames=("state",),
)
def spec_prefill_step(
    params,
    dparams,
    state: SpecState,
    batch: ForwardBatch,
    draft_tokens,
    finish_rows,
    slot_ids,
    counts: PrefillCounts,
    rows: SamplingRows,
    lora: LoraBatch | None = None,
    vocab_mask=None,
    *,
    cfg: ModelConfig,
    method: SpecMethod,
    mode: AttentionMode,
    top_n: int = 0,
    with_prompt_logprobs: bool = False,
    sampling: str = "sampled",
):
    """Target prefill (one ragged chunk batch) plus the method's prefill of the same rows.

    draft_tokens [T]: the token after each row (prompt token t+1); for a row that ends its
    prompt the host does not know it yet, and finish_rows [B] (row index, or T to skip) says
    where the sampled first token goes. slot_ids [B]: carry slot of each sequence whose prompt
    ends in this chunk, else the scratch slot. lora: the adapter pool and each token's adapter
    slot [T], applied by the target only (the draft runs without adapters; it reads the
    target's features, which carry the adapter's effect). vocab_mask: [B, words] token
    bitmasks of the first tokens (None: every token allowed).
    """
    tkv, out = forward(params, cfg, state.target_kv, batch, mode, capture_layers=method.capture_layers, lora=lora)
    first, logits, pen = sample_first_tokens(
        out.logits, state.penalties, batch, slot_ids, counts, rows, sampling, vocab_mask
    )
    next_tokens = draft_tokens.at[finish_rows].set(first, mode="drop")
    ctx = PrefillContext(batch, mode, out, next_tokens, first, slot_ids, counts.token_slots)
    draft, extra = method.prefill(params, dparams, state.draft, ctx)
    c = state.carry
    carry = SpecCarry(
        c.next_token.at[slot_ids].set(first, mode="drop"),
        c.seq_len.at[slot_ids].set(batch.seq_lens, mode="drop"),
        _scatter_rows(c.extra, extra, slot_ids, mode="drop"),
    )
    result = one_token_output(logits, rows, first, top_n)
    if with_prompt_logprobs:  # draft_tokens holds the prompt token after each token
        result = result._replace(prompt=prompt_logprobs(params, cfg, out.hidden, draft_tokens, top_n))
    return SpecState(tkv, draft, carry, pen), pack_output(result)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "method", "backend", "top_n", "sampling", "verify_tokens"),
    donate_argnames=("state",),
)
def spec_decode_step(
    params,
    dparams,
    state: SpecState,
    slot_ids,
    page_tables,
    rows: SamplingRows,
    lora: LoraBatch | None = None,
    drafting=None,
    *,
    cfg: ModelConfig,
    method: SpecMethod,
    backend: str = "pallas",
    top_n: int = 0,
    sampling: str = "sampled",
    verify_tokens: int | None = None,
) -> tuple[SpecState, PackedOutput]:
    """One speculative iteration (propose -> verify -> accept -> update) for the requests in
    slot_ids [B] (padding rows: the scratch slot), in one dispatch.

    page_tables [B, M] must cover positions < n + method.kv_margin of each request.
    lora: the adapter pool and each row's adapter slot [B], for the target's verify forward.
    drafting [B] bool with verify_tokens (static): rows opted out of drafting verify their root
    alone, in a forward over verify_tokens ragged tokens (verify.verify_tree).
    """
    c = gather_slots(state.carry, slot_ids)
    draft, tree = method.propose(params, dparams, state.draft, c, page_tables, slot_ids, backend)
    batch = VerifyBatch(tree, slot_ids, page_tables, rows, lora, drafting=drafting)
    return _verify_update(
        params,
        dparams,
        state,
        draft,
        c,
        batch,
        cfg=cfg,
        method=method,
        backend=backend,
        top_n=top_n,
        sampling=sampling,
        verify_tokens=verify_tokens,
    )


@functools.partial(jax.jit, static_argnames=("cfg", "method", "backend"), donate_argnames=("state",))
def spec_propose_step(
    params, dparams, state: SpecState, slot_ids, page_tables, *, cfg: ModelConfig, method: SpecMethod, backend: str
):
    """The method's proposal alone -> (state with the draft's state advanced, the verify tree)."""
    c = gather_slots(state.carry, slot_ids)
    draft, tree = method.propose(params, dparams, state.draft, c, page_tables, slot_ids, backend)
    return state._replace(draft=draft), tree


@functools.partial(
    jax.jit, static_argnames=("cfg", "method", "backend", "top_n", "sampling"), donate_argnames=("state",)
)
def spec_verify_step(
    params,
    dparams,
    state: SpecState,
    tree: DraftTree,
    slot_ids,
    page_tables,
    rows: SamplingRows,
    lora: LoraBatch | None,
    node_masks,
    *,
    cfg: ModelConfig,
    method: SpecMethod,
    backend: str = "pallas",
    top_n: int = 0,
    sampling: str = "sampled",
) -> tuple[SpecState, PackedOutput]:
    """The rest of spec_decode_step after spec_propose_step: verify the tree with the target's
    logits at each node masked by node_masks [B, N, words] (the tokens the grammar allows after
    the node's path), accept, update the draft."""
    c = gather_slots(state.carry, slot_ids)
    batch = VerifyBatch(tree, slot_ids, page_tables, rows, lora, node_masks)
    return _verify_update(
        params,
        dparams,
        state,
        state.draft,
        c,
        batch,
        cfg=cfg,
        method=method,
        backend=backend,
        top_n=top_n,
        sampling=sampling,
    )


def _verify_update(
    params,
    dparams,
    state: SpecState,
    draft,
    c: SpecCarry,
    batch: VerifyBatch,
    *,
    cfg: ModelConfig,
    method: SpecMethod,
    backend: str,
    top_n: int,
    sampling: str,
    verify_tokens: int | None = None,
):
    """Verifies the batch's trees against the target, accepts, and moves the carry, the
    penalty counts and the method's draft state (the proposal's) past the accepted tokens."""
    v = verify_tree(
        params,
        cfg,
        state.target_kv,
        batch.tree,
        c.seq_len,
        batch.page_tables,
        batch.rows,
        state.penalties,
        batch.slot_ids,
        num_steps=method.spec.num_steps,
        chain=method.chain,
        backend=backend,
        capture_layers=method.capture_layers,
        sampling=sampling,
        top_n=top_n,
        lora=batch.lora,
        node_masks=batch.node_masks,
        drafting=batch.drafting,
        verify_tokens=verify_tokens,
    )
    draft, extra = method.update(params, dparams, draft, c, v, batch.page_tables, batch.slot_ids, backend)
    new = SpecCarry(v.acc.bonus, c.seq_len + v.acc.accept_len + 1, extra)
    carry = _scatter_rows(state.carry, new, batch.slot_ids)
    pen = record_emitted(state.penalties, batch.slot_ids, v.acc.tokens)
    return SpecState(v.target_kv, draft, carry, pen), pack_output(v.output)

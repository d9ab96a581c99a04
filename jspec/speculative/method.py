"""The speculative-method interface and the two jitted steps every method runs through.

A method (EAGLE / EAGLE-3, STANDALONE, NGRAM) says:
- what device state it keeps beside the target's: `draft` (a draft KV pool, a token
  history, ...) and per-slot `extra` carry (the draft's top-k and hidden state, ...);
- what its prefill adds after the target's prefill forward;
- how it proposes the verify tree from the carry (on the device, inside the iteration);
- how its draft state follows the accepted tokens.
Everything else (the target forward over the tree, penalties, acceptance, logprobs, KV
moves, the FutureMap carry and the scheduler) is shared and never names a method.

Methods are frozen dataclasses, hashable, passed to the steps as static arguments.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.config.spec import SpecConfig
from jspec.kvcache.pool import KVPool
from jspec.layers.batch import AttentionMode, ForwardBatch
from jspec.layers.lora import LoraBatch
from jspec.layers.penalties import PenaltyState, PrefillCounts, record_emitted
from jspec.layers.sampling import SamplingRows
from jspec.models.common import ForwardOutput
from jspec.models.forward import forward
from jspec.speculative.tree import DraftTree
from jspec.speculative.verify import Verified, verify_tree
from jspec.steps.common import (
    PackedOutput,
    gather_slots,
    one_token_output,
    pack_output,
    prompt_logprobs,
    sample_first_tokens,
)


class SpecCarry(NamedTuple):
    """Per request slot; the last slot is scratch for padded batch rows.

    Carry convention (as steps.py): the target KV holds positions 0..seq_len-1 and
    next_token = x_{seq_len} is the last verified token, the root of the next tree.
    """

    next_token: jax.Array  # [slots+1] int32
    seq_len: jax.Array  # [slots+1] int32
    extra: Any  # the method's per-slot carry: a pytree of [slots+1, ...] arrays


class SpecState(NamedTuple):
    target_kv: KVPool
    draft: Any  # the method's own device state (draft KV pool, token history, ...)
    carry: SpecCarry
    penalties: PenaltyState


class PrefillContext(NamedTuple):
    """What a method's prefill sees of the target's prefill."""

    batch: ForwardBatch
    mode: AttentionMode
    out: ForwardOutput  # the target's forward (hidden / captured layers of every token)
    next_tokens: jax.Array  # [T] the token after each token (the sampled first token at a prompt's end)
    first: jax.Array  # [B] sampled first tokens
    slot_ids: jax.Array  # [B] slot of each row whose prompt ends here, else the scratch slot
    token_slots: jax.Array  # [T] slot of each token's request (scratch for padding)


class SpecMethod:
    """Base of every method. Subclasses are frozen dataclasses with a `spec: SpecConfig` field."""

    spec: SpecConfig

    @property
    def chain(self) -> bool:
        """Static: node i of every proposed tree sits at depth i."""
        return self.spec.num_draft_tokens == self.spec.num_steps + 1 and self.spec.eagle_topk == 1

    @property
    def kv_margin(self) -> int:
        """Target KV positions past the verified length that one iteration may write."""
        return max(self.spec.num_draft_tokens, self.spec.num_steps + 1)

    capture_layers: tuple[int, ...] = ()  # target layers whose input the method reads (EAGLE-3)

    def draft_kv_bytes_per_page(self, page_size: int, dtype) -> int:
        """Bytes the method's draft state takes per KV page (sizes the shared page budget)."""
        return 0

    def init_draft(self, num_slots: int, num_pages: int, page_size: int, dtype) -> Any:
        raise NotImplementedError

    def init_extra(self, num_slots: int, dtype) -> Any:
        return ()

    def prefill(self, params, dparams, draft, ctx: PrefillContext) -> tuple[Any, Any]:
        """-> (draft, extra rows for ctx.slot_ids)."""
        raise NotImplementedError

    def propose(
        self, params, dparams, draft, c: SpecCarry, page_tables, slot_ids, backend: str
    ) -> tuple[Any, DraftTree]:
        """Gathered carry c (rows of this batch) -> (draft, the verify tree rooted at c.next_token)."""
        raise NotImplementedError

    def update(
        self, params, dparams, draft, c: SpecCarry, v: Verified, page_tables, slot_ids, backend: str
    ) -> tuple[Any, Any]:
        """After acceptance -> (draft, new extra rows for this batch)."""
        raise NotImplementedError


def init_spec_state(
    method: SpecMethod,
    target_kv: KVPool,
    num_slots: int,
    num_pages: int,
    page_size: int,
    dtype,
    penalties: PenaltyState,
) -> SpecState:
    n = num_slots + 1
    carry = SpecCarry(jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), method.init_extra(num_slots, dtype))
    return SpecState(target_kv, method.init_draft(num_slots, num_pages, page_size, dtype), carry, penalties)


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
    return _verify_update(
        params,
        dparams,
        state,
        draft,
        c,
        tree,
        slot_ids,
        page_tables,
        rows,
        lora,
        None,
        cfg,
        method,
        backend,
        top_n,
        sampling,
        drafting,
        verify_tokens,
    )


# Structured outputs split the iteration in two dispatches: the host reads the proposed tree
# between them and masks every node by the grammar state of its path (constrained/tree.py).


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
    return _verify_update(
        params,
        dparams,
        state,
        state.draft,
        c,
        tree,
        slot_ids,
        page_tables,
        rows,
        lora,
        node_masks,
        cfg,
        method,
        backend,
        top_n,
        sampling,
    )


def _verify_update(
    params,
    dparams,
    state: SpecState,
    draft,
    c: SpecCarry,
    tree: DraftTree,
    slot_ids,
    page_tables,
    rows,
    lora,
    node_masks,
    cfg,
    method,
    backend,
    top_n,
    sampling,
    drafting=None,
    verify_tokens=None,
):
    v = verify_tree(
        params,
        cfg,
        state.target_kv,
        tree,
        c.seq_len,
        page_tables,
        rows,
        state.penalties,
        slot_ids,
        num_steps=method.spec.num_steps,
        chain=method.chain,
        backend=backend,
        capture_layers=method.capture_layers,
        sampling=sampling,
        top_n=top_n,
        lora=lora,
        node_masks=node_masks,
        drafting=drafting,
        verify_tokens=verify_tokens,
    )
    draft, extra = method.update(params, dparams, draft, c, v, page_tables, slot_ids, backend)
    new = SpecCarry(v.acc.bonus, c.seq_len + v.acc.accept_len + 1, extra)
    carry = _scatter_rows(state.carry, new, slot_ids)
    pen = record_emitted(state.penalties, slot_ids, v.acc.tokens)
    return SpecState(v.target_kv, draft, carry, pen), pack_output(v.output)

"""EAGLE / EAGLE-3 speculative decoding as pure jitted steps over donated state.

One decode iteration is one dispatch: draft (num_steps - 1 draft forwards
growing an EAGLE-2 tree) -> build tree -> verify (one target forward over
every tree node with the tree mask) -> greedy accept -> move the accepted
path's KV into place -> draft-extend over the accepted tokens (which gives the
next iteration's carry). Nothing in it reads a device value on the host.

Sequence bookkeeping, per request slot (see models/eagle.py for the draft's
position convention):
- carry.seq_len = n: the target KV holds positions 0..n-1, the draft KV holds
  pairs (x_{t+1}, feature_t) for t = 0..n-1;
- carry.next_token = x_n, the token verified last, not yet in the target KV: it
  is the root of the next tree;
- carry.topk_p / topk_ids: the draft's top-k for x_{n+1} (from position n-1),
  carry.hidden: the draft's output at n-1 (its feature for the next step).

KV over-allocation: an iteration writes target KV at positions n..n+N-1 (tree
nodes in node order) and draft KV at n..n+num_steps, so the host keeps pages
for n + spec_kv_margin(spec) positions; only the device knows n + accepted.
Draft tree steps keep their K/V in a small dense buffer (per beam, its
ancestors), never in the pool: attention there is the paged prefix merged
with the beam's own ancestors by log-sum-exp.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig, SpecConfig
from jspec.models.attention import dense_attention_with_lse, merge_attention, paged_decode_with_lse
from jspec.models.batch import AttentionMode, ForwardBatch
from jspec.models.eagle import (
    draft_embed,
    draft_layers,
    draft_logits,
    is_eagle3,
    layer_config,
    target_feature,
    to_target_ids,
)
from jspec.models.llama import forward, paged_attend, rope_cos_sin
from jspec.paged_kv.pool import KVPool
from jspec.scheduler.batch_builder import bucket
from jspec.penalties import PenaltyState, PrefillCounts, apply_tree_penalties, record_emitted
from jspec.sampling import SamplingRows, token_logprobs
from jspec.spec.accept import sampled_accept
from jspec.steps import StepOutput, gather_slots, one_token_output, prompt_logprobs, sample_first_tokens, slots_of
from jspec.spec.tree import append_step, build_tree, expand_beams, start_candidates


class SpecCarry(NamedTuple):
    """Per request slot; the last slot is scratch for padded batch rows."""

    next_token: jax.Array  # [slots+1] int32
    seq_len: jax.Array  # [slots+1] int32
    topk_p: jax.Array  # [slots+1, topk] float32
    topk_ids: jax.Array  # [slots+1, topk] int32, target vocabulary
    hidden: jax.Array  # [slots+1, H] draft feature for the next step


class SpecState(NamedTuple):
    target_kv: KVPool
    draft_kv: KVPool
    carry: SpecCarry
    penalties: PenaltyState


def spec_kv_margin(spec: SpecConfig) -> int:
    """KV positions past the verified length that one iteration may write."""
    return max(spec.num_draft_tokens, spec.num_steps + 1)


def init_carry(num_slots: int, topk: int, hidden_size: int, dtype) -> SpecCarry:
    n = num_slots + 1
    return SpecCarry(
        jnp.zeros(n, jnp.int32),
        jnp.zeros(n, jnp.int32),
        jnp.zeros((n, topk), jnp.float32),
        jnp.zeros((n, topk), jnp.int32),
        jnp.zeros((n, hidden_size), dtype),
    )


def _target_features(dcfg, out) -> jax.Array:
    """[T, H] (EAGLE: final-normed hidden) or [T, 3H] (EAGLE-3: captured layers, low to high)."""
    if is_eagle3(dcfg):
        c = out.captured  # [3, T, H]
        return jnp.moveaxis(c, 0, 1).reshape(c.shape[1], -1)
    return out.hidden


def _draft_topk(dparams, dcfg, params, out_hidden, topk: int):
    logits = draft_logits(dparams, dcfg, params, out_hidden)
    probs = jax.nn.softmax(logits, axis=-1)
    p, ids = jax.lax.top_k(probs, topk)
    return p, to_target_ids(dparams, ids)


def _draft_paged_forward(params, dparams, dcfg, dkv: KVPool, batch: ForwardBatch, mode: AttentionMode, tokens, hidden):
    lcfg = layer_config(dcfg)
    cos, sin = rope_cos_sin(lcfg, batch.positions)
    out, (k, v) = draft_layers(
        dparams, dcfg, draft_embed(dparams, params), tokens, hidden, cos, sin,
        lambda i: paged_attend(lcfg, mode, batch, jnp.int32(i)), (dkv.k, dkv.v),
    )
    return KVPool(k, v), out


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "spec", "mode", "top_n", "with_prompt_logprobs",
                                             "sampling"), donate_argnames=("state",))
def spec_prefill_step(
    params, dparams, state: SpecState, batch: ForwardBatch, draft_tokens, finish_rows, slot_ids,
    counts: PrefillCounts, rows: SamplingRows, *, cfg: ModelConfig, dcfg, spec: SpecConfig, mode: AttentionMode,
    top_n: int = 0, with_prompt_logprobs: bool = False, sampling: str = "filtered",
):
    """Target prefill (one ragged chunk batch) plus the draft's prefill of the same rows.

    draft_tokens [T]: the token after each row (prompt token t+1); for a row that
    ends its prompt the host does not know it yet, and finish_rows [B] (row
    index, or T to skip) says where the sampled first token goes. slot_ids [B]:
    carry slot of each sequence whose prompt ends in this chunk, else the scratch slot.
    Returns (state, first tokens [B]).
    """
    capture = tuple(dcfg.capture_layers) if is_eagle3(dcfg) else ()
    tkv, out = forward(params, cfg, state.target_kv, batch, mode, capture_layers=capture)
    first, logits, pen = sample_first_tokens(out.logits, state.penalties, batch, slot_ids, counts, rows, sampling)
    dtoks = draft_tokens.at[finish_rows].set(first, mode="drop")
    hidden = target_feature(dparams, dcfg, _target_features(dcfg, out))
    dkv, dout = _draft_paged_forward(params, dparams, dcfg, state.draft_kv, batch._replace(tokens=dtoks), mode, dtoks, hidden)
    last = dout[batch.logits_indices]
    p, ids = _draft_topk(dparams, dcfg, params, last, spec.eagle_topk)
    c = state.carry
    carry = SpecCarry(
        c.next_token.at[slot_ids].set(first, mode="drop"),
        c.seq_len.at[slot_ids].set(batch.seq_lens, mode="drop"),
        c.topk_p.at[slot_ids].set(p, mode="drop"),
        c.topk_ids.at[slot_ids].set(ids, mode="drop"),
        c.hidden.at[slot_ids].set(last.astype(c.hidden.dtype), mode="drop"),
    )
    result = one_token_output(logits, rows, first, top_n)
    if with_prompt_logprobs:  # draft_tokens holds the prompt token after each token
        result = result._replace(prompt=prompt_logprobs(params, cfg, out.hidden, draft_tokens, top_n))
    return SpecState(tkv, dkv, carry, pen), result


def _draft_tree(params, dparams, dcfg, spec: SpecConfig, draft_kv: KVPool, c: SpecCarry, page_tables, backend):
    """num_steps - 1 draft forwards over topk beams, accumulating the EAGLE-2 tree candidates."""
    B, K = c.topk_p.shape
    steps = spec.num_steps
    lcfg = layer_config(dcfg)
    n = c.seq_len
    cands = start_candidates(c.topk_p, c.topk_ids)
    H = c.hidden.shape[-1]
    beam_hidden = jnp.broadcast_to(c.hidden[:, None, :], (B, K, H))
    anc_shape = (dcfg.num_layers, B, K, max(steps - 1, 1), dcfg.num_kv_heads, dcfg.head_dim)
    anc = (jnp.zeros(anc_shape, c.hidden.dtype), jnp.zeros(anc_shape, c.hidden.dtype))
    beam_pages = jnp.repeat(page_tables, K, axis=0)
    beam_prefix = jnp.repeat(n, K)
    sm_scale = 1.0 / math.sqrt(dcfg.head_dim)
    embed = draft_embed(dparams, params)
    for i in range(1, steps):
        # Beams at depth i sit at position n + i - 1; they see the draft prefix
        # 0..n-1 in the pool and their own ancestors at depths 1..i here.
        def attend_for_layer(li, i=i):
            def attend(q, k_new, v_new, anc):
                ak = anc[0].at[li, :, :, i - 1].set(k_new.reshape(B, K, *k_new.shape[1:]))
                av = anc[1].at[li, :, :, i - 1].set(v_new.reshape(B, K, *v_new.shape[1:]))
                out_p, lse_p = paged_decode_with_lse(
                    q, draft_kv.k, draft_kv.v, jnp.int32(li), beam_prefix, beam_pages, sm_scale=sm_scale, backend=backend
                )
                lk = ak[li].reshape(B * K, *ak.shape[3:])
                lv = av[li].reshape(B * K, *av.shape[3:])
                visible = jnp.broadcast_to(jnp.arange(lk.shape[1]) < i, (B * K, lk.shape[1]))
                out_l, lse_l = dense_attention_with_lse(q, lk, lv, visible, sm_scale=sm_scale)
                return merge_attention(out_p, lse_p, out_l, lse_l).astype(q.dtype), (ak, av)

            return attend

        pos = beam_prefix + (i - 1)
        cos, sin = rope_cos_sin(lcfg, pos)
        out, anc = draft_layers(
            dparams, dcfg, embed, cands.beam_tokens.reshape(B * K), beam_hidden.reshape(B * K, H), cos, sin,
            attend_for_layer, anc,
        )
        p, ids = _draft_topk(dparams, dcfg, params, out, K)
        step = expand_beams(cands.beam_scores, p.reshape(B, K, K), ids.reshape(B, K, K))
        cands = append_step(cands, step)
        # New beams continue from their parents: carry the parents' hidden and ancestors.
        parent = step.beam_parent
        beam_hidden = jnp.take_along_axis(out.reshape(B, K, H), parent[:, :, None], axis=1)
        anc = tuple(
            jnp.take_along_axis(a, parent[None, :, :, None, None, None], axis=2) for a in anc
        )
    return build_tree(cands.scores, cands.tokens, cands.parents, c.next_token, spec.num_draft_tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "spec", "backend", "top_n", "sampling"),
                   donate_argnames=("state",))
def spec_decode_step(
    params, dparams, state: SpecState, slot_ids, page_tables, rows: SamplingRows,
    *, cfg: ModelConfig, dcfg, spec: SpecConfig, backend: str = "pallas", top_n: int = 0, sampling: str = "filtered",
):
    """One speculative iteration for the requests in slot_ids [B] (padding rows: the scratch slot).

    page_tables [B, M] must cover positions < n + spec_kv_margin(spec) of each request.
    Returns (state, StepOutput).
    """
    B = slot_ids.shape[0]
    steps, N = spec.num_steps, spec.num_draft_tokens
    page_size, num_pages = state.target_kv.page_size, state.target_kv.num_pages
    drop = num_pages * page_size
    c = gather_slots(state.carry, slot_ids)
    n = c.seq_len

    tree = _draft_tree(params, dparams, dcfg, spec, state.draft_kv, c, page_tables, backend)

    # Verify every node at once: node i's KV goes to position n + i (node order),
    # its RoPE position is n + depth, and the tree mask replaces causality.
    node_pos = n[:, None] + jnp.arange(N, dtype=jnp.int32)[None]
    Q = bucket(N)
    mask = jnp.zeros((B, Q, Q), bool).at[:, :N, :N].set(tree.mask)
    verify = ForwardBatch(
        tokens=tree.tokens.reshape(-1),
        positions=(n[:, None] + tree.depths).reshape(-1),
        slots=slots_of(page_tables, node_pos, page_size).reshape(-1),
        seq_lens=n + N,
        page_tables=page_tables,
        query_start=jnp.arange(B + 1, dtype=jnp.int32) * N,
        logits_indices=jnp.arange(B * N, dtype=jnp.int32),
    )
    capture = tuple(dcfg.capture_layers) if is_eagle3(dcfg) else ()
    tkv, out = forward(
        params, cfg, state.target_kv, verify, AttentionMode(False, Q, backend), capture_layers=capture, mask=mask
    )
    node_logits = apply_tree_penalties(out.logits.reshape(B, N, -1), state.penalties, slot_ids, rows.params,
                                       tree.tokens, tree.mask)
    acc = sampled_accept(tree, node_logits, rows, n + 1, steps, sampling)
    m = acc.accept_len
    depth = jnp.arange(steps + 1, dtype=jnp.int32)[None]
    valid = depth <= m[:, None]
    path = jnp.where(valid, acc.path, 0)
    # Emitted token d was drawn at node path[d]: its logprob is the target's there.
    E = steps + 1
    emitted_logits = jnp.take_along_axis(node_logits, path[:, :, None], axis=1).reshape(B * E, -1)
    lp, top_ids, top_lp = token_logprobs(
        emitted_logits, jax.tree.map(lambda a: jnp.repeat(a, E, axis=0), rows),
        jnp.where(valid, acc.tokens, 0).reshape(-1), top_n,
    )

    if spec.eagle_topk > 1:
        # Accepted nodes were written in node order; move them to their depth's position.
        src = slots_of(page_tables, n[:, None] + path, page_size)
        dst = jnp.where(valid, slots_of(page_tables, n[:, None] + depth, page_size), drop)
        tkv = KVPool(*(_move_kv(cache, src, dst) for cache in tkv))

    # Draft-extend over the emitted tokens: pair (x_{t+1}, feature_t) at position t for t = n..n+m.
    feats = _target_features(dcfg, out).reshape(B, N, -1)
    feats = jnp.take_along_axis(feats, path[:, :, None], axis=1).reshape(B * E, -1)
    ext_pos = n[:, None] + depth
    extend = ForwardBatch(
        tokens=jnp.where(valid, acc.tokens, 0).reshape(-1),
        positions=ext_pos.reshape(-1),
        slots=jnp.where(valid, slots_of(page_tables, ext_pos, page_size), drop).reshape(-1),
        seq_lens=n + E,
        page_tables=page_tables,
        query_start=jnp.arange(B + 1, dtype=jnp.int32) * E,
        logits_indices=jnp.arange(B, dtype=jnp.int32) * E + m,
    )
    hidden = target_feature(dparams, dcfg, feats)
    dkv, dout = _draft_paged_forward(
        params, dparams, dcfg, state.draft_kv, extend, AttentionMode(False, bucket(E), backend), extend.tokens, hidden
    )
    last = dout[extend.logits_indices]
    p, ids = _draft_topk(dparams, dcfg, params, last, spec.eagle_topk)

    new = SpecCarry(acc.bonus, n + m + 1, p, ids, last.astype(c.hidden.dtype))
    carry = jax.tree.map(lambda full, part: full.at[slot_ids].set(part), state.carry, new)
    out_logprobs = StepOutput(acc.tokens, m, lp.reshape(B, E), top_ids.reshape(B, E, top_n), top_lp.reshape(B, E, top_n))
    pen = record_emitted(state.penalties, slot_ids, acc.tokens)
    return SpecState(tkv, dkv, carry, pen), out_logprobs


def _move_kv(cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copies slots src -> dst ([B, X] flat slot ids) in every layer; dst out of range is skipped.
    All reads happen before any write, so overlapping source and destination are safe."""
    L, P, S, H, D = cache.shape
    flat = cache.reshape(L, P * S, H, D)
    vals = flat[:, src.reshape(-1)]
    flat = flat.at[:, dst.reshape(-1)].set(vals, mode="drop")
    return flat.reshape(L, P, S, H, D)

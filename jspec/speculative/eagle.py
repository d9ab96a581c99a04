"""EAGLE / EAGLE-3 as a SpecMethod: propose an EAGLE-2 beam tree from the carry's top-k (or the
(1,1,2) chain with no draft forward), then a draft-extend over the emitted tokens.

Per slot: carry.seq_len = n, the draft KV holds pairs (x_{t+1}, feature_t) for t < n,
carry.next_token = x_n is the next tree's root, carry.extra holds the draft's top-k for
x_{n+1} and its output at n-1. The host keeps pages for n + kv_margin positions; beams'
K/V stay in a small dense buffer, never in the pool.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.draft import DraftConfig
from jspec.config.model import ModelConfig
from jspec.config.spec import SpecConfig
from jspec.kvcache.pool import KVPool, create_kv_pool, kv_bytes_per_page
from jspec.layers.batch import AttentionMode, ForwardBatch, bucket
from jspec.models.eagle import (
    draft_embed,
    draft_layers,
    draft_logits,
    is_eagle3,
    layer_config,
    target_feature,
    to_target_ids,
)
from jspec.models.llama import PagedAttend, rope_cos_sin
from jspec.speculative.beams import grow_beam_tree
from jspec.speculative.method import PrefillContext, SpecCarry, SpecMethod
from jspec.speculative.tree import chains_tree
from jspec.speculative.verify import Verified
from jspec.steps.common import slots_of


class EagleExtra(NamedTuple):
    """EAGLE's per-slot carry beside next_token / seq_len: the draft's output at n-1, its feature
    for the next step. The draft's top-k after the root is taken from it by the shape that drafts
    (propose), not carried, so an iteration that drafts nothing (adaptive speculation's off
    shape) never runs the draft's LM head."""

    hidden: jax.Array  # [slots+1, H]


@dataclasses.dataclass(frozen=True)
class EagleMethod(SpecMethod):
    """EAGLE / EAGLE-3 (dcfg.algorithm): the draft head, its own paged KV, EAGLE-2 beam trees."""

    spec: SpecConfig
    dcfg: DraftConfig | ModelConfig  # the head's; NextnMethod's is the target's ModelConfig

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(self.dcfg.capture_layers) if is_eagle3(self.dcfg) else ()

    def init_draft(self, num_slots, num_pages, page_size, dtype):
        return create_kv_pool(layer_config(self.dcfg), num_pages, page_size, dtype)

    def draft_kv_bytes_per_page(self, page_size, dtype):
        return kv_bytes_per_page(layer_config(self.dcfg), page_size, dtype)

    def init_extra(self, num_slots, dtype):
        return EagleExtra(jnp.zeros((num_slots + 1, self.dcfg.hidden_size), dtype))

    def prefill(self, params, dparams, dkv, ctx: PrefillContext):
        # The draft's prefill over the same rows: pair (x_{t+1}, feature_t) at position t.
        hidden = self.draft_hidden(dparams, self.target_features(ctx.out))
        dkv, dout = self.draft_forward(
            params, dparams, dkv, ctx.batch._replace(tokens=ctx.next_tokens), ctx.mode, ctx.next_tokens, hidden
        )
        return dkv, EagleExtra(dout[ctx.batch.logits_indices])

    def propose(self, params, dparams, dkv, c: SpecCarry, page_tables, slot_ids, backend):
        if self.spec.num_steps == 0:  # root only; update's draft-extend keeps the draft current
            return dkv, chains_tree(c.next_token, jnp.zeros((c.next_token.shape[0], 1, 0), jnp.int32))
        if self.spec.num_steps == 1 and self.spec.eagle_topk == 1:
            # The high-throughput path (1 step, topk 1, 2 verify tokens): the draft token is the
            # top-1 of the last draft-extend's output; no draft forward, no tree search.
            _, ids = self.draft_topk(params, dparams, c.extra.hidden, 1)
            return dkv, chains_tree(c.next_token, ids[:, None, :])
        return dkv, self.draft_tree(params, dparams, dkv, c, page_tables, backend)

    def update(self, params, dparams, dkv, c: SpecCarry, v: Verified, page_tables, slot_ids, backend):
        # Draft-extend over the emitted tokens: pair (x_{t+1}, feature_t) at position t for t = n..n+m.
        n, m = c.seq_len, v.acc.accept_len
        B, E = v.acc.tokens.shape
        N = self.spec.num_draft_tokens
        drop = dkv.num_pages * dkv.page_size
        depth = jnp.arange(E, dtype=jnp.int32)[None]
        feats = self.target_features(v.out).reshape(B, N, -1)
        feats = jnp.take_along_axis(feats, v.path[:, :, None], axis=1).reshape(B * E, -1)
        ext_pos = n[:, None] + depth
        extend = ForwardBatch(
            tokens=jnp.where(v.valid, v.acc.tokens, 0).reshape(-1),
            positions=ext_pos.reshape(-1),
            slots=jnp.where(v.valid, slots_of(page_tables, ext_pos, dkv.page_size), drop).reshape(-1),
            seq_lens=n + E,
            page_tables=page_tables,
            query_start=jnp.arange(B + 1, dtype=jnp.int32) * E,
            logits_indices=jnp.arange(B, dtype=jnp.int32) * E + m,
        )
        hidden = self.draft_hidden(dparams, feats)
        dkv, dout = self.draft_forward(
            params, dparams, dkv, extend, AttentionMode(False, bucket(E), backend), extend.tokens, hidden
        )
        return dkv, EagleExtra(dout[extend.logits_indices])

    # The draft model's parts; NEXTN (speculative/nextn.py) replaces them with an MTP layer's.

    def target_features(self, out) -> jax.Array:
        return _target_features(self.dcfg, out)

    def draft_hidden(self, dparams, feats) -> jax.Array:
        return target_feature(dparams, self.dcfg, feats)

    def draft_forward(self, params, dparams, dkv, batch, mode, tokens, hidden):
        return _draft_paged_forward(params, dparams, self.dcfg, dkv, batch, mode, tokens, hidden)

    def draft_topk(self, params, dparams, out_hidden, topk: int):
        return _draft_topk(dparams, self.dcfg, params, out_hidden, topk)

    def draft_tree(self, params, dparams, dkv, c: SpecCarry, page_tables, backend):
        return _draft_tree(params, dparams, self.dcfg, self.spec, dkv, c, page_tables, backend)


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
        dparams,
        dcfg,
        draft_embed(dparams, params),
        tokens,
        hidden,
        cos,
        sin,
        lambda i: PagedAttend(lcfg, mode, batch, jnp.int32(i)),
        (dkv.k, dkv.v),
    )
    return KVPool(k, v), out


def _draft_tree(params, dparams, dcfg, spec: SpecConfig, draft_kv: KVPool, c: SpecCarry, page_tables, backend):
    """num_steps - 1 head forwards over topk beams (speculative/beams.py), from the carry's top-k."""
    e = c.extra
    lcfg = layer_config(dcfg)
    embed = draft_embed(dparams, params)
    K = spec.eagle_topk
    first_p, first_ids = _draft_topk(dparams, dcfg, params, e.hidden, K)  # the root's children

    def step_fn(tokens, hidden, positions, attend_for_layer, anc):
        cos, sin = rope_cos_sin(lcfg, positions)
        out, anc = draft_layers(dparams, dcfg, embed, tokens, hidden, cos, sin, attend_for_layer, anc)
        p, ids = _draft_topk(dparams, dcfg, params, out, K)
        return p, ids, out, anc

    # Beams at depth i sit at position n + i - 1 (the draft's shifted convention): prefix 0..n-1.
    return grow_beam_tree(
        c.next_token,
        first_p,
        first_ids,
        e.hidden,
        c.seq_len,
        page_tables,
        draft_kv,
        step_fn,
        num_steps=spec.num_steps,
        num_draft_tokens=spec.num_draft_tokens,
        backend=backend,
    )

"""NGRAM speculation: drafts copied from earlier occurrences of the request's own recent tokens.

The device keeps every request's token history, so matching runs inside the jitted
iteration. A candidate is an earlier position whose last r tokens equal those ending at the
root (r the longest such run within the match windows); the `breadth` best candidates each
propose the tokens that followed them as a chain from the root. `match_candidates_ref` is the
brute-force reference of the matcher.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config.spec import SpecConfig
from jspec.speculative.method import PrefillContext, SpecCarry, SpecMethod
from jspec.speculative.tree import chains_tree
from jspec.speculative.verify import Verified

PAD = 0


def match_candidates(history: jax.Array, n: jax.Array, *, min_window: int, max_window: int, breadth: int):
    """history [B, C] (positions 0..n valid), n [B] -> (ends [B, breadth], match lengths [B, breadth]).

    ends[b, i] is the i-th best earlier position j < n[b] (longest match, then latest);
    match length 0 means no candidate (then ends is -1).
    """
    B, C = history.shape
    j = jnp.arange(C, dtype=jnp.int32)[None]  # candidate end positions
    run = jnp.zeros((B, C), jnp.int32)
    alive = jnp.ones((B, C), bool)
    for k in range(max_window):
        mine = jnp.take_along_axis(history, jnp.maximum(n - k, 0)[:, None], axis=1)  # [B, 1]
        theirs = jnp.take_along_axis(history, jnp.maximum(j - k, 0), axis=1)
        alive &= (theirs == mine) & (j - k >= 0) & ((n - k)[:, None] >= 0)
        run += alive
    ok = (j < n[:, None]) & (run >= min_window) & (run > 0)
    score = jnp.where(ok, run * C + j, -1)
    best, ends = jax.lax.top_k(score, breadth)
    found = best >= 0
    return jnp.where(found, ends, -1).astype(jnp.int32), jnp.where(found, best // C, 0).astype(jnp.int32)


def match_candidates_ref(history: np.ndarray, n: int, *, min_window: int, max_window: int, breadth: int):
    """The brute-force reference of match_candidates for one request."""
    cands = []
    for j in range(n):
        r = 0
        while r < max_window and j - r >= 0 and history[j - r] == history[n - r]:
            r += 1
        if r >= max(min_window, 1):
            cands.append((r, j))
    cands.sort(reverse=True)
    cands = cands[:breadth]
    ends = [j for _, j in cands] + [-1] * (breadth - len(cands))
    lens = [r for r, _ in cands] + [0] * (breadth - len(cands))
    return ends, lens


@dataclasses.dataclass(frozen=True)
class NgramMethod(SpecMethod):
    spec: SpecConfig
    capacity: int  # history positions per request (the model's context plus the KV margin)

    def init_draft(self, num_slots, num_pages, page_size, dtype):
        return jnp.full((num_slots + 1, self.capacity), PAD, jnp.int32)

    def prefill(self, params, dparams, history, ctx: PrefillContext):
        b = ctx.batch
        history = history.at[ctx.token_slots, b.positions].set(b.tokens, mode="drop")
        history = history.at[ctx.slot_ids, b.seq_lens].set(ctx.first, mode="drop")
        return history, ()

    def propose(self, params, dparams, history, c: SpecCarry, page_tables, slot_ids, backend):
        s = self.spec
        breadth, length = s.eagle_topk, s.num_steps
        if length == 0:  # root only
            return history, chains_tree(c.next_token, jnp.zeros((slot_ids.shape[0], 1, 0), jnp.int32))
        rows = history[slot_ids]
        n = c.seq_len
        ends, _ = match_candidates(
            rows, n, min_window=s.ngram_min_match_window_size, max_window=s.ngram_max_match_window_size, breadth=breadth
        )
        follow = ends[:, :, None] + 1 + jnp.arange(length, dtype=jnp.int32)[None, None]  # [B, breadth, L]
        known = (ends[:, :, None] >= 0) & (follow <= n[:, None, None])
        flat = jnp.clip(follow, 0, self.capacity - 1).reshape(rows.shape[0], -1)
        drafts = jnp.where(known, jnp.take_along_axis(rows, flat, axis=1).reshape(follow.shape), PAD)
        return history, chains_tree(c.next_token, drafts)

    def update(self, params, dparams, history, c: SpecCarry, v: Verified, page_tables, slot_ids, backend):
        E = v.acc.tokens.shape[1]
        pos = c.seq_len[:, None] + 1 + jnp.arange(E, dtype=jnp.int32)[None]
        pos = jnp.where(v.valid, pos, self.capacity)  # out of range: dropped
        rows = jnp.broadcast_to(slot_ids[:, None], pos.shape)
        return history.at[rows, pos].set(v.acc.tokens, mode="drop"), ()

"""STANDALONE speculation: a separate small model of the same tokenizer drafts autoregressively.

The draft is any model the loader reads (a ModelConfig + params, run by models/llama.py)
with its own paged KV pool, page for page beside the target's. Per iteration, with root
x_n at position n and prev = x_{n-1}:

- the draft runs [prev, root] at positions n-1, n (rewriting n-1 makes the pool whole
  after an iteration that accepted every draft, whose last draft was never fed), takes
  its argmax d_1, then feeds d_i at n+i for i = 1..num_steps-1: a chain root, d_1..d_S;
- after verification, prev becomes the token at n + accepted; the draft KV at
  n..n+accepted holds exactly the accepted tokens, so nothing needs recomputing.

Drafts are the draft's argmax: a deterministic proposal, so verification (the target's
own draw at each node, matched against the drafts) stays exact for any temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig, SpecConfig
from jspec.models.batch import AttentionMode, ForwardBatch
from jspec.models.llama import forward
from jspec.paged_kv.pool import create_kv_pool, kv_bytes_per_page
from jspec.spec.method import PrefillContext, SpecCarry, SpecMethod
from jspec.spec.tree import chains_tree
from jspec.spec.verify import Verified
from jspec.steps import slots_of


@dataclasses.dataclass(frozen=True)
class StandaloneMethod(SpecMethod):
    spec: SpecConfig
    dcfg: ModelConfig

    def init_draft(self, num_slots, num_pages, page_size, dtype):
        return create_kv_pool(self.dcfg, num_pages, page_size, dtype)

    def draft_kv_bytes_per_page(self, page_size, dtype):
        return kv_bytes_per_page(self.dcfg, page_size, dtype)

    def init_extra(self, num_slots, dtype):
        return jnp.zeros(num_slots + 1, jnp.int32)  # prev: the token at seq_len - 1

    def prefill(self, params, dparams, dkv, ctx: PrefillContext):
        dkv, _ = forward(dparams, self.dcfg, dkv, ctx.batch, ctx.mode)
        return dkv, ctx.batch.tokens[ctx.batch.logits_indices]

    def propose(self, params, dparams, dkv, c: SpecCarry, page_tables, slot_ids, backend):
        B = c.seq_len.shape[0]
        n, S = jnp.maximum(c.seq_len, 1), dkv.page_size  # padding rows (length 0) run at 1 harmlessly
        pos = jnp.stack([n - 1, n], axis=1)  # [B, 2]
        first = ForwardBatch(
            tokens=jnp.stack([c.extra, c.next_token], axis=1).reshape(-1),
            positions=pos.reshape(-1),
            slots=slots_of(page_tables, pos, S).reshape(-1),
            seq_lens=n + 1,
            page_tables=page_tables,
            query_start=jnp.arange(B + 1, dtype=jnp.int32) * 2,
            logits_indices=jnp.arange(B, dtype=jnp.int32) * 2 + 1,
        )
        dkv, out = forward(dparams, self.dcfg, dkv, first, AttentionMode(False, 2, backend))
        tok = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        drafts = [tok]
        for i in range(1, self.spec.num_steps):
            p = n + i
            step = ForwardBatch(
                tokens=tok, positions=p, slots=slots_of(page_tables, p[:, None], S)[:, 0], seq_lens=p + 1,
                page_tables=page_tables, query_start=jnp.arange(B + 1, dtype=jnp.int32),
                logits_indices=jnp.arange(B, dtype=jnp.int32),
            )
            dkv, out = forward(dparams, self.dcfg, dkv, step, AttentionMode(True, 1, backend))
            tok = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
            drafts.append(tok)
        return dkv, chains_tree(c.next_token, jnp.stack(drafts, axis=1)[:, None, :])

    def update(self, params, dparams, dkv, c: SpecCarry, v: Verified, page_tables, slot_ids, backend):
        m = v.acc.accept_len
        prev = jnp.take_along_axis(v.acc.tokens, jnp.maximum(m - 1, 0)[:, None], axis=1)[:, 0]
        return dkv, jnp.where(m > 0, prev, c.next_token)

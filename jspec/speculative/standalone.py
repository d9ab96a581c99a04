"""STANDALONE speculation: a separate small model of the same tokenizer drafts.

The draft has its own paged pool beside the target's. Per iteration it reruns [prev, root]
(which makes its pool whole after a fully accepted iteration), then drafts a chain of its
argmax tokens (writing its pool as it goes) or grows EAGLE-2 beams (speculative/beams.py)
and writes the accepted tokens' KV after verification. Drafts are deterministic proposals,
so the target's own draws keep verification exact at any temperature.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.config.spec import SpecConfig
from jspec.kvcache.pool import create_kv_pool, kv_bytes_per_page
from jspec.layers.batch import AttentionMode, ForwardBatch, bucket
from jspec.layers.norm import rms_norm
from jspec.models.common import compute_logits, run_layers
from jspec.models.forward import forward
from jspec.models.llama import attention_input, decoder_layer, embed_tokens, layer_rope, rope_cos_sin
from jspec.speculative.beams import grow_beam_tree
from jspec.speculative.method import PrefillContext, SpecCarry, SpecMethod
from jspec.speculative.tree import chains_tree
from jspec.speculative.verify import Verified
from jspec.steps.common import slots_of


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
        if self.spec.num_steps == 0:  # root only: the forward above kept the draft's KV current
            return dkv, chains_tree(c.next_token, jnp.zeros((B, 1, 0), jnp.int32))
        if self.spec.eagle_topk > 1:
            return dkv, self._beam_tree(dparams, dkv, c, out.logits, n, page_tables, backend)
        tok = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        drafts = [tok]
        for i in range(1, self.spec.num_steps):
            p = n + i
            step = ForwardBatch(
                tokens=tok,
                positions=p,
                slots=slots_of(page_tables, p[:, None], S)[:, 0],
                seq_lens=p + 1,
                page_tables=page_tables,
                query_start=jnp.arange(B + 1, dtype=jnp.int32),
                logits_indices=jnp.arange(B, dtype=jnp.int32),
            )
            dkv, out = forward(dparams, self.dcfg, dkv, step, AttentionMode(True, 1, backend))
            tok = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
            drafts.append(tok)
        return dkv, chains_tree(c.next_token, jnp.stack(drafts, axis=1)[:, None, :])

    def _beam_tree(self, dparams, dkv, c: SpecCarry, root_logits, n, page_tables, backend):
        dcfg, K = self.dcfg, self.spec.eagle_topk
        layers = dparams["layers"]

        def top(logits):
            return jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), K)

        def step_fn(tokens, state, positions, attend_for_layer, anc):
            cos, sin = rope_cos_sin(dcfg, positions)
            x = embed_tokens(dparams, dcfg, tokens)

            def layer_body(carry, lp, layer):
                x, anc = carry
                h = attention_input(dcfg, lp, x)
                layer_cos, layer_sin = layer_rope(dcfg, layer, (cos, sin), None)
                return decoder_layer(dcfg, lp, x, h, layer_cos, layer_sin, attend_for_layer(layer), anc)

            x, anc = run_layers(layers, layer_body, (x, anc))
            p, ids = top(compute_logits(dparams, dcfg, rms_norm(x, dparams["final_norm"], dcfg.rms_norm_eps)))
            return p, ids.astype(jnp.int32), state, anc

        p, ids = top(root_logits)
        # Beams at depth i sit at position n + i and see the pool's 0..n (the root included).
        return grow_beam_tree(
            c.next_token,
            p,
            ids.astype(jnp.int32),
            jnp.zeros((n.shape[0], 1), jnp.int32),
            n + 1,
            page_tables,
            dkv,
            step_fn,
            num_steps=self.spec.num_steps,
            num_draft_tokens=self.spec.num_draft_tokens,
            backend=backend,
        )

    def update(self, params, dparams, dkv, c: SpecCarry, v: Verified, page_tables, slot_ids, backend):
        if self.spec.eagle_topk > 1:
            # The beams' K/V never reached the pool: write the accepted drafts' (n+1..n+m) now;
            # the bonus at n+m+1 is the next root, which the next iteration feeds itself.
            B, E = v.acc.tokens.shape
            depth = jnp.arange(E, dtype=jnp.int32)[None]
            pos = c.seq_len[:, None] + 1 + depth
            accepted = depth < v.acc.accept_len[:, None]
            drop = dkv.num_pages * dkv.page_size
            extend = ForwardBatch(
                tokens=jnp.where(accepted, v.acc.tokens, 0).reshape(-1),
                positions=pos.reshape(-1),
                slots=jnp.where(accepted, slots_of(page_tables, pos, dkv.page_size), drop).reshape(-1),
                seq_lens=c.seq_len + 1 + E,
                page_tables=page_tables,
                query_start=jnp.arange(B + 1, dtype=jnp.int32) * E,
                logits_indices=jnp.arange(B, dtype=jnp.int32) * E,
            )
            dkv, _ = forward(dparams, self.dcfg, dkv, extend, AttentionMode(False, bucket(E), backend))
        m = v.acc.accept_len
        prev = jnp.take_along_axis(v.acc.tokens, jnp.maximum(m - 1, 0)[:, None], axis=1)[:, 0]
        return dkv, jnp.where(m > 0, prev, c.next_token)

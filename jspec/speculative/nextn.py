"""NEXTN: the target checkpoint's own multi-token-prediction layer drafts, EAGLE's way
(DeepSeek-V3's, or MiMo's on Qwen2: models/mtp.py).

The MTP layer (model.layers.{num_hidden_layers}) reads, at position t, the embedding of
x_{t+1} and the target's final-normed hidden state at t, and predicts x_{t+2} through the
target's lm_head: exactly an EAGLE head's contract, so NEXTN is EagleMethod with the MTP layer
as its draft (same carry, draft-extend, beam trees and chains). Deeper draft steps feed the
layer its own normed output, as SGLang does. With several MTP layers the first one drafts.
Its KV is a one-layer pool laid out as the target's: latent for MLA (absorbed attention in
the beams, expanded in prefill and draft-extend), K and V for standard attention.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.kvcache.pool import KVPool, create_kv_pool, kv_bytes_per_page
from jspec.models.common import lm_head_logits
from jspec.models.deepseek import absorbed_attend, paged_mla_attend
from jspec.models.forward import rope_cos_sin
from jspec.models.llama import PagedAttend
from jspec.models.mtp import mtp_layer
from jspec.speculative.beams import grow_beam_tree
from jspec.speculative.eagle import EagleMethod
from jspec.speculative.method import SpecCarry


@dataclasses.dataclass(frozen=True)
class NextnMethod(EagleMethod):
    """dcfg is the target's ModelConfig; dparams {"mtp": the MTP layer's weights, and "embed" /
    "lm_head" only when the checkpoint's copies differ from the target's}."""

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def init_draft(self, num_slots, num_pages, page_size, dtype):
        return create_kv_pool(self.dcfg, num_pages, page_size, dtype, num_layers=1)

    def draft_kv_bytes_per_page(self, page_size, dtype):
        return kv_bytes_per_page(self.dcfg, page_size, dtype) // self.dcfg.num_layers

    def target_features(self, out) -> jax.Array:
        return out.hidden

    def draft_hidden(self, dparams, feats) -> jax.Array:
        return feats

    def draft_forward(self, params, dparams, dkv, batch, mode, tokens, hidden):
        cfg = self.dcfg
        cos, sin = rope_cos_sin(cfg, batch.positions)
        embed = _embed(params, dparams)
        if cfg.deepseek is not None:
            attend = paged_mla_attend(cfg, mode, batch, jnp.int32(0))
            out, k = mtp_layer(cfg, dparams["mtp"], embed, tokens, batch.positions, hidden, cos, sin, attend, dkv.k)
            return KVPool(k, dkv.v), out
        attend = PagedAttend(cfg, mode, batch, jnp.int32(0))
        out, kv = mtp_layer(cfg, dparams["mtp"], embed, tokens, batch.positions, hidden, cos, sin, attend, tuple(dkv))
        return KVPool(*kv), out

    def draft_topk(self, params, dparams, out_hidden, topk: int):
        logits = lm_head_logits(dparams if "lm_head" in dparams else params, out_hidden)
        p, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), topk)
        return p, ids.astype(jnp.int32)

    def draft_tree(self, params, dparams, dkv, c: SpecCarry, page_tables, backend):
        cfg, K = self.dcfg, self.spec.eagle_topk
        e = c.extra
        embed = _embed(params, dparams)

        def step_fn(tokens, hidden, positions, attend_for_layer, anc):
            cos, sin = rope_cos_sin(cfg, positions)
            attend = absorbed_attend(attend_for_layer(0)) if cfg.deepseek is not None else attend_for_layer(0)
            out, anc = mtp_layer(cfg, dparams["mtp"], embed, tokens, positions, hidden, cos, sin, attend, anc)
            p, ids = self.draft_topk(params, dparams, out, K)
            return p, ids, out, anc

        first_p, first_ids = self.draft_topk(params, dparams, e.hidden, K)  # the root's children
        return grow_beam_tree(
            c.next_token,
            first_p,
            first_ids,
            e.hidden,
            c.seq_len,
            page_tables,
            dkv,
            step_fn,
            num_steps=self.spec.num_steps,
            num_draft_tokens=self.spec.num_draft_tokens,
            backend=backend,
            latent_values=cfg.deepseek.kv_lora_rank if cfg.deepseek is not None else 0,
            sm_scale=cfg.deepseek.sm_scale if cfg.deepseek is not None else None,
        )


def _embed(params, dparams) -> jax.Array:
    return dparams["embed"] if "embed" in dparams else params["embed"]

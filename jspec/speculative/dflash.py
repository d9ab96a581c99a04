"""DFlash as a SpecMethod: one non-causal block forward drafts the whole chain.

Per slot: carry.seq_len = n and the draft pool holds, at every position t < n, each draft
layer's key and value of the context feature of the committed token x_t (the target's states
at the chosen layers while it processed x_t): exactly as causal as the target's own KV, so
prefix caching, retraction and chunked prefill treat both pools alike. The iteration:

- propose: the block [x_n (the root), mask x s] at positions n..n+s is written into the draft
  pool at those positions and attends to the context 0..n-1 and to the whole block (a full
  mask over the new tokens); its outputs at rows 1..s, through the target's head, are the
  chain's s drafts (their argmax: deterministic proposals keep the shared verify exact).
- update: the verify forward captured the target's states at every node; those of the
  accepted path (the root and the accepted drafts, positions n..n+m) become context keys and
  values at their positions, overwriting the block's. What the block wrote past n+m is stale
  and never read: the next block starts at n+m+1 and rewrites its own positions first.

A shape of s = 0 steps (adaptive speculation off) verifies the root alone and still injects it,
so the draft stays current; a shorter s runs a shorter block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.checkpoint.dflash import load_dflash_model
from jspec.config.dflash import DFlashConfig
from jspec.config.model import ModelConfig
from jspec.config.spec import DFLASH_ADAPTIVE_SHAPES, SpecConfig
from jspec.kvcache.pool import KVPool, create_kv_pool, kv_bytes_per_page
from jspec.layers.batch import AttentionMode, ForwardBatch, bucket
from jspec.models.dflash import block_embeddings, block_layers, draft_logits, inject_context
from jspec.models.llama import PagedAttend, rope_cos_sin
from jspec.speculative.method import PrefillContext, SpecCarry, SpecMethod
from jspec.speculative.tree import chains_tree
from jspec.speculative.verify import Verified
from jspec.steps.common import slots_of


def captured_features(out) -> jax.Array:
    """[T, C*H]: the target states of each row at the capture layers, in the config's order."""
    c = out.captured  # [C, T, H]
    return jnp.moveaxis(c, 0, 1).reshape(c.shape[1], -1)


@dataclasses.dataclass(frozen=True)
class DFlashMethod(SpecMethod):
    spec: SpecConfig
    dcfg: DFlashConfig

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.dcfg.capture_layers

    def init_draft(self, num_slots, num_pages, page_size, dtype):
        return create_kv_pool(self.dcfg.layers, num_pages, page_size, dtype)

    def draft_kv_bytes_per_page(self, page_size, dtype):
        return kv_bytes_per_page(self.dcfg.layers, page_size, dtype)

    def prefill(self, params, dparams, dkv, ctx: PrefillContext):
        b = ctx.batch
        return inject_context(dparams, self.dcfg, dkv, captured_features(ctx.out), b.positions, b.slots), ()

    def propose(self, params, dparams, dkv, c: SpecCarry, page_tables, slot_ids, backend):
        s = self.spec.num_steps
        B = c.seq_len.shape[0]
        if s == 0:  # root only; update still injects the root's context
            return dkv, chains_tree(c.next_token, jnp.zeros((B, 1, 0), jnp.int32))
        n, Q = c.seq_len, s + 1
        pos = n[:, None] + jnp.arange(Q, dtype=jnp.int32)[None]  # [B, Q]
        tokens = jnp.concatenate([c.next_token[:, None], jnp.full((B, s), self.dcfg.mask_token_id, jnp.int32)], 1)
        block = ForwardBatch(
            tokens=tokens.reshape(-1),
            positions=pos.reshape(-1),
            slots=slots_of(page_tables, pos, dkv.page_size).reshape(-1),
            seq_lens=n + Q,
            page_tables=page_tables,
            query_start=jnp.arange(B + 1, dtype=jnp.int32) * Q,
            logits_indices=jnp.arange(B * Q, dtype=jnp.int32),
        )
        dkv, logits = self.block_logits(params, dparams, dkv, block, backend)  # [B * Q, V]
        drafts = jnp.argmax(logits.reshape(B, Q, -1)[:, 1:], axis=-1).astype(jnp.int32)
        return dkv, chains_tree(c.next_token, drafts[:, None, :])

    def block_logits(self, params, dparams, dkv, block: ForwardBatch, backend: str) -> tuple[KVPool, jax.Array]:
        """The block forward -> (the pool with the block's K/V written, its rows' draft logits
        [T, V]). The written pool is the one kept: dropping it would make XLA copy the whole
        pool, since the old one would then be read after the write."""
        cfg: ModelConfig = self.dcfg.layers
        B = block.seq_lens.shape[0]
        Q = block.tokens.shape[0] // B
        M = bucket(Q)
        full = jnp.zeros((B, M, M), bool).at[:, :Q, :Q].set(True)  # every block row sees every other
        mode = AttentionMode(False, M, backend)
        cos, sin = rope_cos_sin(cfg, block.positions)
        x = block_embeddings(params, self.dcfg, block.tokens).astype(dkv.k.dtype)

        def attend_for_layer(layer):
            return PagedAttend(cfg, mode, block, jnp.int32(layer) if isinstance(layer, int) else layer, full)

        h, caches = block_layers(dparams, self.dcfg, x, cos, sin, attend_for_layer, (dkv.k, dkv.v))
        return KVPool(*caches), draft_logits(params, self.dcfg, h)

    def update(self, params, dparams, dkv, c: SpecCarry, v: Verified, page_tables, slot_ids, backend):
        # The accepted path's target states become context at n..n+m; the rest is not written.
        B, E = v.acc.tokens.shape
        feats = captured_features(v.out)
        feats = feats.reshape(B, -1, feats.shape[-1])  # [B, N, C*H]
        feats = jnp.take_along_axis(feats, v.path[:, :, None], axis=1).reshape(B * E, -1)
        pos = c.seq_len[:, None] + jnp.arange(E, dtype=jnp.int32)[None]
        drop = dkv.num_pages * dkv.page_size
        slots = jnp.where(v.valid, slots_of(page_tables, pos, dkv.page_size), drop)
        return inject_context(dparams, self.dcfg, dkv, feats, pos.reshape(-1), slots.reshape(-1)), ()


def make_dflash_method(spec: SpecConfig, cfg: ModelConfig, draft, dtype, draft_dir) -> tuple[DFlashMethod, dict]:
    """-> (method, draft params): draft is (DFlashConfig, params) already in memory, else
    draft_dir() names the checkpoint. An unset --speculative-num-draft-tokens drafts the
    checkpoint's whole block; every shape must fit in it."""
    if draft is None:
        draft = load_dflash_model(draft_dir(), cfg, dtype=dtype)
    dcfg, dparams = draft
    if not isinstance(dcfg, DFlashConfig):
        raise ValueError(f"a DFLASH draft is (DFlashConfig, params), got a {type(dcfg).__name__}")
    if dcfg.hidden_size != cfg.hidden_size or dcfg.layers.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"the DFlash drafter (hidden {dcfg.hidden_size}, vocabulary {dcfg.layers.vocab_size}) does not fit the "
            f"target (hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size})"
        )
    if max(dcfg.capture_layers) >= cfg.num_layers:
        raise ValueError(f"DFlash target_layer_ids {dcfg.target_layer_ids} must be below {cfg.num_layers - 1}")
    if spec.num_draft_tokens is None:
        spec = dataclasses.replace(spec, num_draft_tokens=dcfg.block_size)
    if spec.adaptive and spec.adaptive_shapes == DFLASH_ADAPTIVE_SHAPES:
        # The default shorter blocks that this drafter's block holds; shapes given are checked.
        fits = [shape for shape in spec.shapes()[1:] if shape[2] <= dcfg.block_size]
        spec = dataclasses.replace(spec, adaptive_shapes=" ".join(",".join(map(str, shape)) for shape in fits))
    widest = max(n for _, _, n in spec.shapes())
    if widest > dcfg.block_size:
        raise ValueError(
            f"DFLASH verifies at most the drafter's block of {dcfg.block_size} tokens; "
            f"--speculative-num-draft-tokens (or an adaptive shape) asks for {widest}"
        )
    return DFlashMethod(spec, dcfg), dparams

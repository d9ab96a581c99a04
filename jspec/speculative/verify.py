"""Verification shared by every speculative method: one target forward over the draft tree,
penalties, acceptance, the emitted tokens' logprobs, and the accepted path's KV put in place.

A method only proposes the tree (and updates its own draft state from the result); this
module never knows which method proposed it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.config.model import ModelConfig
from jspec.kvcache.pool import KVPool
from jspec.layers.batch import AttentionMode, ForwardBatch, bucket
from jspec.layers.lora import LoraBatch
from jspec.layers.penalties import PenaltyState, apply_tree_penalties
from jspec.layers.sampling import SamplingRows, apply_vocab_mask, token_logprobs
from jspec.models.common import ForwardOutput
from jspec.models.forward import forward
from jspec.speculative.accept import AcceptResult, sampled_accept
from jspec.speculative.tree import DraftTree
from jspec.steps.common import StepOutput, slots_of


class Verified(NamedTuple):
    target_kv: KVPool
    acc: AcceptResult
    path: jax.Array  # [B, S+1] accepted nodes by depth, 0 past accept_len
    valid: jax.Array  # [B, S+1] depth <= accept_len
    out: ForwardOutput  # the target's forward over the tree nodes (hidden / captured layers per node)
    output: StepOutput  # what the host reads back


def verify_tree(
    params,
    cfg: ModelConfig,
    target_kv: KVPool,
    tree: DraftTree,
    n: jax.Array,
    page_tables: jax.Array,
    rows: SamplingRows,
    penalties: PenaltyState,
    slot_ids: jax.Array,
    *,
    num_steps: int,
    chain: bool,
    backend: str,
    capture_layers: tuple[int, ...] = (),
    sampling: str = "sampled",
    top_n: int = 0,
    lora: LoraBatch | None = None,
    node_masks=None,
    drafting: jax.Array | None = None,
    verify_tokens: int | None = None,
) -> Verified:
    """tree: N nodes per request, root = the last verified token at position n [B]; chain (static):
    node i is at depth i, so accepted nodes already sit where they belong.

    Node i's KV goes to position n + i (node order), its RoPE position is n + depth, and the tree
    mask replaces causality; after acceptance the accepted nodes' KV moves to n + depth.
    page_tables [B, M] must cover positions < n + N.
    lora: the adapter pool and each request's adapter slot [B] (every node takes its request's).
    node_masks: [B, N, words] token bitmasks, the tokens allowed after each node's path (None:
    all). The target's draw at every node then comes from its distribution renormalised over
    them, so a draft outside the grammar is never accepted and the bonus stays inside it.
    drafting [B] bool with verify_tokens (static): rows that verify their tree; the others verify
    their root alone. The forward then runs over verify_tokens ragged tokens (each row's nodes
    back to back, the tail padding) instead of B * N, and its outputs are laid out as B x N again.
    """
    B, N = tree.tokens.shape
    page_size, num_pages = target_kv.page_size, target_kv.num_pages
    Q = bucket(N)
    mask = jnp.zeros((B, Q, Q), bool).at[:, :N, :N].set(tree.mask)
    batch, counts, node_valid, flat = tree_batch(tree, n, page_tables, target_kv, drafting, verify_tokens)
    T = batch.tokens.shape[0]
    if lora is not None:
        lora = lora._replace(token_slots=jnp.repeat(lora.token_slots, counts, total_repeat_length=T))
    tkv, out = forward(
        params,
        cfg,
        target_kv,
        batch,
        AttentionMode(False, Q, backend),
        capture_layers=capture_layers,
        mask=mask,
        lora=lora,
    )
    if drafting is not None:
        # Back to B x N rows: a node that was not verified reads row 0 (never accepted).
        rows_of = jnp.where(node_valid, flat, 0).reshape(-1)
        out = ForwardOutput(
            out.logits[rows_of],
            out.hidden[rows_of],
            None if out.captured is None else out.captured[:, rows_of],
        )
    node_logits = apply_tree_penalties(
        out.logits.reshape(B, N, -1), penalties, slot_ids, rows.params, tree.tokens, tree.mask
    )
    if node_masks is not None:
        node_logits = apply_vocab_mask(node_logits.reshape(B * N, -1), node_masks.reshape(B * N, -1)).reshape(B, N, -1)
    acc = sampled_accept(tree, node_logits, rows, n + 1, num_steps, sampling, node_valid)
    E = num_steps + 1
    depth = jnp.arange(E, dtype=jnp.int32)[None]
    valid = depth <= acc.accept_len[:, None]
    path = jnp.where(valid, acc.path, 0)

    # Emitted token d was drawn at node path[d]: its logprob is the target's there.
    emitted_logits = jnp.take_along_axis(node_logits, path[:, :, None], axis=1).reshape(B * E, -1)
    lp, top_ids, top_lp = token_logprobs(
        emitted_logits,
        jax.tree.map(lambda a: jnp.repeat(a, E, axis=0), rows),
        jnp.where(valid, acc.tokens, 0).reshape(-1),
        top_n,
    )
    if not chain:
        # Accepted nodes were written in node order; move them to their depth's position.
        src = slots_of(page_tables, n[:, None] + path, page_size)
        dst = jnp.where(valid, slots_of(page_tables, n[:, None] + depth, page_size), num_pages * page_size)
        tkv = KVPool(*(_move_kv(cache, src, dst) for cache in tkv))
    output = StepOutput(
        acc.tokens, acc.accept_len, lp.reshape(B, E), top_ids.reshape(B, E, top_n), top_lp.reshape(B, E, top_n)
    )
    return Verified(tkv, acc, path, valid, out, output)


def tree_batch(tree: DraftTree, n, page_tables, target_kv: KVPool, drafting, verify_tokens: int | None):
    """The target's forward batch over the tree nodes -> (batch, nodes per row [B], node_valid
    [B, N] or None, each node's row in the batch [B, N] or None). Every row holds its N nodes
    back to back; with drafting, a row that does not draft holds its root alone, in a batch of
    verify_tokens tokens whose tail is padding."""
    B, N = tree.tokens.shape
    page_size, num_pages = target_kv.page_size, target_kv.num_pages
    node_pos = n[:, None] + jnp.arange(N, dtype=jnp.int32)[None]
    node_slots = slots_of(page_tables, node_pos, page_size)
    positions = n[:, None] + tree.depths
    if drafting is None:
        batch = ForwardBatch(
            tokens=tree.tokens.reshape(-1),
            positions=positions.reshape(-1),
            slots=node_slots.reshape(-1),
            seq_lens=n + N,
            page_tables=page_tables,
            query_start=jnp.arange(B + 1, dtype=jnp.int32) * N,
            logits_indices=jnp.arange(B * N, dtype=jnp.int32),
        )
        return batch, jnp.full(B, N, jnp.int32), None, None
    T = verify_tokens
    counts = jnp.where(drafting, N, 1).astype(jnp.int32)
    query_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    node_valid = jnp.arange(N, dtype=jnp.int32)[None] < counts[:, None]
    flat = jnp.where(node_valid, query_start[:-1, None] + jnp.arange(N, dtype=jnp.int32)[None], T)
    scatter = lambda fill, x: jnp.full(T, fill, jnp.int32).at[flat.reshape(-1)].set(x.reshape(-1), mode="drop")  # noqa: E731
    batch = ForwardBatch(
        tokens=scatter(0, tree.tokens),
        positions=scatter(0, positions),
        slots=scatter(num_pages * page_size, node_slots),  # the tail writes no KV
        seq_lens=n + counts,
        page_tables=page_tables,
        query_start=query_start,
        logits_indices=jnp.arange(T, dtype=jnp.int32),
    )
    return batch, counts, node_valid, flat


def _move_kv(cache: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Copies slots src -> dst ([B, X] flat slot ids) in every layer; dst out of range is skipped.
    All reads happen before any write, so overlapping source and destination are safe."""
    L, P, S, H, D = cache.shape
    flat = cache.reshape(L, P * S, H, D)
    # The barrier keeps the gather out of the scatter's fusion: a fused scatter that also reads
    # the buffer it writes cannot write it in place, and XLA would copy the whole pool leaf.
    vals = jax.lax.optimization_barrier(flat[:, src.reshape(-1)])
    flat = flat.at[:, dst.reshape(-1)].set(vals, mode="drop")
    return flat.reshape(L, P, S, H, D)

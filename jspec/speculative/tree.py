"""EAGLE-2 dynamic draft tree: beam expansion while drafting, then the verify tree.

`topk` beams per request over `num_steps` steps; every expansion is a candidate, in a fixed
order. The verify tree is the root plus the best num_draft_tokens - 1 candidates by
cumulative score, ordered by candidate index: a child's score is at most its parent's and
its index is larger, so a kept child's parent is kept and parents come first. Pure jnp over
a request axis, static shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def candidate_count(topk: int, num_steps: int) -> int:
    """Tree candidates one request accumulates over `num_steps` draft steps."""
    return topk + (num_steps - 1) * topk * topk


class BeamStep(NamedTuple):
    """One draft step >= 1: all topk*topk expansions and the topk new beams."""

    cand_scores: jax.Array  # [B, topk*topk] float, beam score * draft prob, (beam, k) order
    cand_tokens: jax.Array  # [B, topk*topk] int32
    beam_scores: jax.Array  # [B, topk] float, best first
    beam_tokens: jax.Array  # [B, topk] int32
    beam_parent: jax.Array  # [B, topk] int32, old beam (0..topk-1) each new beam expands
    beam_cand: jax.Array  # [B, topk] int32, index among this step's topk*topk candidates


def expand_beams(beam_scores: jax.Array, step_probs: jax.Array, step_tokens: jax.Array) -> BeamStep:
    """beam_scores [B, topk], step_probs/step_tokens [B, topk, topk] (row j: beam j's top-k) -> BeamStep."""
    b, topk = beam_scores.shape
    cand_scores = (beam_scores[:, :, None] * step_probs).reshape(b, topk * topk)
    cand_tokens = step_tokens.reshape(b, topk * topk).astype(jnp.int32)
    new_scores, new_cand = jax.lax.top_k(cand_scores, topk)
    new_cand = new_cand.astype(jnp.int32)
    new_tokens = jnp.take_along_axis(cand_tokens, new_cand, axis=1)
    return BeamStep(cand_scores, cand_tokens, new_scores, new_tokens, new_cand // topk, new_cand)


class DraftCandidates(NamedTuple):
    """Tree candidates accumulated so far plus the current beams.

    A draft loop (a static Python for-loop inside jit) threads it through:
        cands = start_candidates(p0, t0)
        for _ in range(1, num_steps):
            probs, toks = <draft forward on cands.beam_tokens>  # [B, topk, topk]
            step = expand_beams(cands.beam_scores, probs, toks)
            cands = append_step(cands, step)
            <gather hidden state / ancestor KV by step.beam_parent>
        tree = build_tree(cands.scores, cands.tokens, cands.parents, root, n)
    The candidate axis C grows by topk*topk per step (static shapes).
    """

    scores: jax.Array  # [B, C] float, cumulative draft probability
    tokens: jax.Array  # [B, C] int32
    parents: jax.Array  # [B, C] int32, global candidate index of the parent, -1 = root
    beam_scores: jax.Array  # [B, topk] float
    beam_tokens: jax.Array  # [B, topk] int32
    beam_cand: jax.Array  # [B, topk] int32, global candidate index of each beam


def start_candidates(step0_probs: jax.Array, step0_tokens: jax.Array) -> DraftCandidates:
    """Step 0: the draft's top-k after the root, [B, topk] each; all of them are beams."""
    b, topk = step0_probs.shape
    tokens = step0_tokens.astype(jnp.int32)
    index = jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32), (b, topk))
    root_parent = jnp.full((b, topk), -1, jnp.int32)
    return DraftCandidates(step0_probs, tokens, root_parent, step0_probs, tokens, index)


def append_step(cands: DraftCandidates, step: BeamStep) -> DraftCandidates:
    """Adds a step's topk*topk expansions (parent = the beam each expanded) and moves to its beams."""
    offset = cands.scores.shape[1]
    topk = cands.beam_cand.shape[1]
    # Expansion (j, k) sits at j*topk + k, so repeating beam j's index topk times lines up.
    parents = jnp.repeat(cands.beam_cand, topk, axis=1)
    return DraftCandidates(
        scores=jnp.concatenate([cands.scores, step.cand_scores], axis=1),
        tokens=jnp.concatenate([cands.tokens, step.cand_tokens], axis=1),
        parents=jnp.concatenate([cands.parents, parents], axis=1),
        beam_scores=step.beam_scores,
        beam_tokens=step.beam_tokens,
        beam_cand=offset + step.beam_cand,
    )


class DraftTree(NamedTuple):
    """The verify tree, N = num_draft_tokens nodes per request, node 0 = root.

    Nodes are in candidate order, so parents precede children and siblings
    follow the draft's ranking within one top-k.
    """

    tokens: jax.Array  # [B, N] int32, node 0 = the root token (last verified token)
    parents: jax.Array  # [B, N] int32, parent node, -1 for the root
    depths: jax.Array  # [B, N] int32, root 0; position of node i = seq position of root + depth
    mask: jax.Array  # [B, N, N] bool, mask[b, i, j]: node i attends to node j (j == i or ancestor)
    cand_index: jax.Array  # [B, N] int32, candidate index of each node, -1 for the root
    first_child: jax.Array  # [B, N] int32, lowest-index child, -1 if a leaf
    next_sibling: jax.Array  # [B, N] int32, next higher-index node with the same parent, -1 if none


def build_tree(
    cand_scores: jax.Array,
    cand_tokens: jax.Array,
    cand_parents: jax.Array,
    root_tokens: jax.Array,
    num_draft_tokens: int,
) -> DraftTree:
    """cand_* [B, C] (parents: global candidate index, -1 = child of root), root_tokens [B] -> DraftTree.

    Assumes each child's score <= its parent's (true for probabilities): a kept
    candidate whose parent was dropped would get parent -1.
    """
    b, c = cand_scores.shape
    n = num_draft_tokens
    if not 1 <= n <= c + 1:
        raise ValueError(f"num_draft_tokens={n} needs 1..{c + 1} for {c} candidates")
    _, kept = jax.lax.top_k(cand_scores, n - 1)
    kept = jnp.sort(kept.astype(jnp.int32), axis=1)

    rows = jnp.arange(b)[:, None]
    node_of_cand = jnp.full((b, c), -1, jnp.int32).at[rows, kept].set(jnp.arange(1, n, dtype=jnp.int32))
    parent_cand = jnp.take_along_axis(cand_parents.astype(jnp.int32), kept, axis=1)
    parent_node = jnp.where(parent_cand < 0, 0, jnp.take_along_axis(node_of_cand, jnp.maximum(parent_cand, 0), axis=1))

    root_col = jnp.full((b, 1), -1, jnp.int32)
    parents = jnp.concatenate([root_col, parent_node], axis=1)
    tokens = jnp.concatenate(
        [root_tokens.astype(jnp.int32)[:, None], jnp.take_along_axis(cand_tokens.astype(jnp.int32), kept, axis=1)],
        axis=1,
    )
    mask = ancestor_mask(parents)
    depths = mask.sum(axis=-1, dtype=jnp.int32) - 1
    first_child, next_sibling = child_links(parents)
    return DraftTree(
        tokens, parents, depths, mask, jnp.concatenate([root_col, kept], axis=1), first_child, next_sibling
    )


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """parents [B, N] (-1 = root) -> [B, N, N] bool, [b, i, j] iff j is i or an ancestor of i.

    Transitive closure by repeated squaring of "self or parent": log2(N) small
    matmuls instead of an N-long sequential walk.
    """
    n = parents.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    reach = (idx[:, None] == idx[None, :]) | (parents[..., :, None] == idx)
    # After k squarings reach covers paths of up to 2**k edges; depth <= n - 1.
    for _ in range(max(n - 2, 0).bit_length()):
        r = reach.astype(jnp.int32)
        reach = jnp.einsum("bij,bjk->bik", r, r) > 0
    return reach


def child_links(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """parents [B, N] -> (first_child [B, N], next_sibling [B, N]), -1 = none: children in index order."""
    n = parents.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    is_child = parents[..., None, :] == idx[:, None]  # [b, i, j]: j is a child of i
    first_child = jnp.where(is_child.any(-1), jnp.argmax(is_child, axis=-1), -1).astype(jnp.int32)
    # Only the root has parent -1, so roots never count as siblings of anything.
    later_sibling = (parents[..., :, None] == parents[..., None, :]) & (idx[None, :] > idx[:, None])
    next_sibling = jnp.where(later_sibling.any(-1), jnp.argmax(later_sibling, axis=-1), -1).astype(jnp.int32)
    return first_child, next_sibling


def chains_tree(root_tokens: jax.Array, drafts: jax.Array) -> DraftTree:
    """A root [B] plus `breadth` independent chains drafts [B, breadth, L] (a plain chain when
    breadth is 1): the tree shape of drafts that are proposed whole rather than grown by beams."""
    B, breadth, length = drafts.shape
    parents = [-1]
    for _ in range(breadth):
        for i in range(length):
            parents.append(0 if i == 0 else len(parents) - 1)
    par = jnp.asarray(parents, jnp.int32)[None]
    mask = ancestor_mask(par)
    first_child, next_sibling = child_links(par)
    rep = lambda a: jnp.broadcast_to(a, (B, *a.shape[1:]))  # noqa: E731
    tokens = jnp.concatenate([root_tokens.astype(jnp.int32)[:, None], drafts.reshape(B, -1).astype(jnp.int32)], 1)
    return DraftTree(
        tokens,
        rep(par),
        rep(mask.sum(-1, dtype=jnp.int32) - 1),
        rep(mask),
        rep(jnp.arange(len(parents), dtype=jnp.int32)[None] - 1),
        rep(first_child),
        rep(next_sibling),
    )

"""Greedy (temperature 0) verification of a draft tree against the target.

Walk from the root: while the current node has a child whose token equals the
target's argmax at the current node, move to that child (lowest node index if
several match). The accepted drafts plus the target's token at the last
accepted node (the bonus) are exactly what plain greedy decoding would emit,
which makes greedy speculation lossless.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.layers.sampling import sample_tokens
from jspec.speculative.tree import DraftTree


class AcceptResult(NamedTuple):
    """Per request, with m = accept_len and S = num_steps; -1 pads past the valid entries."""

    accept_len: jax.Array  # [B] int32, accepted draft tokens m, 0..S
    path: jax.Array  # [B, S+1] int32, root (0) then accepted nodes by depth; -1 after index m
    bonus: jax.Array  # [B] int32, target_argmax at path[m]
    tokens: jax.Array  # [B, S+1] int32, emitted: m accepted drafts then the bonus; -1 after index m


def greedy_accept(
    tree: DraftTree, target_argmax: jax.Array, num_steps: int, node_valid: jax.Array | None = None
) -> AcceptResult:
    """tree with N nodes, target_argmax [B, N] (target's greedy token after each node) -> AcceptResult.

    num_steps (static) sizes the outputs: tree depth never exceeds it. node_valid [B, N]: nodes
    that were verified (a row verifying its root alone has only node 0); others never accept.
    Vectorised instead of walked: a node is on the accepted path iff every node
    from the root to it is the first child of its parent that the target
    confirms, which is one pass over the ancestor mask.
    """
    n = tree.tokens.shape[1]
    idx = jnp.arange(n, dtype=jnp.int32)
    is_root = tree.parents < 0
    wanted = jnp.take_along_axis(target_argmax, jnp.maximum(tree.parents, 0), axis=1)
    confirmed = (tree.tokens == wanted) & ~is_root
    if node_valid is not None:
        confirmed &= node_valid
    # Keep the lowest-index confirmed child of each parent, so the walk is one path.
    earlier_confirmed_sibling = (
        (tree.parents[:, :, None] == tree.parents[:, None, :]) & (idx[None, :] < idx[:, None]) & confirmed[:, None, :]
    ).any(-1)
    step_ok = (confirmed & ~earlier_confirmed_sibling) | is_root
    accepted = jnp.all(~tree.mask | step_ok[:, None, :], axis=-1)
    accept_len = accepted.sum(axis=-1, dtype=jnp.int32) - 1

    # Accepted nodes have distinct depths 0..m: the depth is their slot in the path.
    at_depth = accepted[:, :, None] & (tree.depths[:, :, None] == jnp.arange(num_steps + 1))
    path = jnp.where(at_depth.any(axis=1), jnp.argmax(at_depth, axis=1), -1).astype(jnp.int32)

    # The draft accepted at depth d+1 equals the target's token at path[d], so
    # the emitted tokens (drafts then bonus) are target_argmax along the path.
    along = jnp.take_along_axis(target_argmax.astype(jnp.int32), jnp.maximum(path, 0), axis=1)
    tokens = jnp.where(path >= 0, along, -1)
    bonus = jnp.take_along_axis(along, accept_len[:, None], axis=1)[:, 0]
    return AcceptResult(accept_len, path, bonus, tokens)


def sampled_accept(
    tree: DraftTree,
    node_logits: jax.Array,
    rows,
    first_pos: jax.Array,
    num_steps: int,
    mode: str = "sampled",
    node_valid: jax.Array | None = None,
) -> AcceptResult:
    """Verification for any temperature: node_logits [B, N, V] (the target's logits after each
    node), rows: SamplingRows [B], first_pos [B]: position of the token after the root.

    The target draws its token after each node (the argmax for greedy rows, else a sample from
    its filtered distribution keyed by (request seed, position), the key plain decoding uses
    there; `mode` as in sampling.sample_tokens), and the walk accepts a child iff the draw equals it. Each emitted token is thus a
    draw from the target's conditional given the accepted prefix: exact speculative sampling
    for deterministic drafts (EAGLE's top-k tree, where the draft distribution is one-hot on
    its candidates, so min(1, p/q) acceptance and the residual p - q reduce to this), chain or
    tree, and the same tokens as non-speculative sampling with the same seed.
    """
    B, N, V = node_logits.shape
    node_rows = jax.tree.map(lambda a: jnp.repeat(a, N, axis=0), rows)
    draw_pos = (first_pos[:, None] + tree.depths).reshape(-1)
    tokens = sample_tokens(node_logits.reshape(B * N, V), node_rows, draw_pos, mode).reshape(B, N)
    return greedy_accept(tree, tokens, num_steps, node_valid)

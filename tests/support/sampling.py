"""Float64 references for the sampling filters, and a fixed draft tree for the verify rules."""

import jax.numpy as jnp
import numpy as np

from jspec.speculative.tree import DraftTree, ancestor_mask, child_links


def reference_keep(x, top_k, top_p, min_p):
    """Which tokens a row's filters keep, token by token in float64 (the rule sampling.py states)."""
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    above = x[None, :] > x[:, None]  # [i, j]: token j's logit exceeds token i's
    keep = np.ones(len(x), bool)
    if top_k > 0:
        keep &= above.sum(1) < top_k
    if top_p < 1:
        keep &= (above * e[None, :]).sum(1) / e.sum() < top_p
    if min_p > 0:
        keep &= x - x.max() >= np.log(min_p)
    return keep


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """The distribution a row must sample from, in float64 numpy."""
    x = logits.astype(np.float64) / temperature
    q = np.where(reference_keep(x, top_k, top_p, min_p), np.exp(x - x.max()), 0.0)
    return q / q.sum()


def fixed_tree(parents, tokens, B):
    parents = jnp.asarray(parents, jnp.int32)
    depths = np.zeros(len(parents), np.int32)
    for i, p in enumerate(np.asarray(parents)):
        depths[i] = 0 if p < 0 else depths[p] + 1
    first, nxt = child_links(parents[None])
    rep = lambda a: jnp.broadcast_to(jnp.asarray(a), (B, *np.shape(a)))  # noqa: E731
    return DraftTree(
        rep(tokens),
        rep(parents),
        rep(depths),
        rep(ancestor_mask(parents[None])[0]),
        rep(np.arange(len(parents)) - 1),
        rep(first[0]),
        rep(nxt[0]),
    )

"""EAGLE-2 draft tree (jspec/speculative/tree.py) against brute-force numpy references.

One jitted program per static (topk, num_steps, num_draft_tokens) runs the whole
draft bookkeeping -> build_tree -> greedy_accept, so every config compiles once
and the tests loop over seeds inside. test_accept.py reuses these helpers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from support.lowering import lower_for_cuda
from support.tree import BATCH, VOCAB, configs, pipeline, random_draft

from jspec.speculative import (
    build_tree,
    expand_beams,
)


def brute_candidates(p0, t0, step_probs, step_tokens):
    """One request, by explicit recursion over the steps -> (scores, tokens, parents, beams per step)."""
    topk = len(p0)
    scores, tokens, parents = list(p0), list(t0), [-1] * topk
    beams = [(p0[k], k) for k in range(topk)]  # (cumulative score, global candidate index)
    history = []
    for probs, toks in zip(step_probs, step_tokens):
        base = len(scores)
        new = [(np.float32(s * probs[j, k]), toks[j, k], g) for j, (s, g) in enumerate(beams) for k in range(topk)]
        scores += [c[0] for c in new]
        tokens += [c[1] for c in new]
        parents += [c[2] for c in new]
        best = np.argsort(-np.float32([c[0] for c in new]), kind="stable")[:topk]
        beams = [(new[o][0], base + int(o)) for o in best]
        history.append(best)
    return np.float32(scores), np.int32(tokens), np.int32(parents), history


def brute_tree(scores, tokens, parents, root, n):
    """One request: top n-1 by score (stable), candidate order, ancestors by walking parents."""
    kept = np.sort(np.argsort(-scores, kind="stable")[: n - 1])
    node = {int(c): i + 1 for i, c in enumerate(kept)}
    t_tokens = np.concatenate([[root], tokens[kept]])
    t_parents = np.int32([-1] + [0 if parents[c] < 0 else node[int(parents[c])] for c in kept])
    mask = np.zeros((n, n), bool)
    depths = np.zeros(n, np.int32)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = t_parents[j]
        depths[i] = mask[i].sum() - 1
    first_child = np.int32([next((j for j in range(n) if t_parents[j] == i), -1) for i in range(n)])
    next_sibling = np.int32(
        [next((j for j in range(i + 1, n) if i > 0 and t_parents[j] == t_parents[i]), -1) for i in range(n)]
    )
    return dict(
        tokens=t_tokens,
        parents=t_parents,
        depths=depths,
        mask=mask,
        cand_index=np.int32([-1] + list(kept)),
        first_child=first_child,
        next_sibling=next_sibling,
    )


def run_config(rng, topk, num_steps, n, target=None, **draft_kw):
    """Random draft through the jitted pipeline; returns (draft inputs, cands, steps, tree, accept) as numpy."""
    draft = random_draft(rng, topk, num_steps, **draft_kw)
    if target is None:
        target = rng.integers(0, VOCAB, size=(BATCH, n), dtype=np.int32)
    out = pipeline(topk, num_steps, n)(*draft, target)
    return draft, *jax.tree.map(np.asarray, out)


def check_against_brute(rng, topk, num_steps, n, **draft_kw):
    (p0, t0, sp, st, root), cands, steps, tree, _ = run_config(rng, topk, num_steps, n, **draft_kw)
    for b in range(BATCH):
        scores, tokens, parents, history = brute_candidates(p0[b], t0[b], sp[:, b], st[:, b])
        np.testing.assert_array_equal(cands.scores[b], scores)
        np.testing.assert_array_equal(cands.tokens[b], tokens)
        np.testing.assert_array_equal(cands.parents[b], parents)
        for step, best, _, toks in zip(steps, history, sp[:, b], st[:, b]):
            np.testing.assert_array_equal(step.beam_cand[b], best)
            np.testing.assert_array_equal(step.beam_parent[b], best // topk)
            np.testing.assert_array_equal(step.beam_tokens[b], toks.reshape(-1)[best])
            np.testing.assert_array_equal(step.beam_scores[b], step.cand_scores[b][best])
        want = brute_tree(scores, tokens, parents, root[b], n)
        for name, value in want.items():
            np.testing.assert_array_equal(
                getattr(tree, name)[b], value, err_msg=f"{name} b={b} cfg={topk, num_steps, n}"
            )
        check_structure(tree, b, cands.parents[b])


def check_structure(tree, b, cand_parents):
    """Invariants that hold for any valid tree, independent of the reference."""
    parents, cand = tree.parents[b], tree.cand_index[b]
    n = len(parents)
    assert parents[0] == -1 and cand[0] == -1 and tree.depths[b, 0] == 0
    for i in range(1, n):
        p = parents[i]
        # The kept child's parent is kept: it is a real node, earlier, and is the candidate's parent.
        assert 0 <= p < i
        assert cand[p] == cand_parents[cand[i]]
        assert tree.depths[b, i] == tree.depths[b, p] + 1
        np.testing.assert_array_equal(tree.mask[b, i], tree.mask[b, p] | (np.arange(n) == i))


def test_build_tree_random_matches_brute_force():
    rng = np.random.default_rng(0)
    for topk, num_steps, n in configs():
        for _ in range(4):
            check_against_brute(rng, topk, num_steps, n)


def test_build_tree_with_ties_matches_brute_force():
    rng = np.random.default_rng(1)
    ties_seen = 0
    for topk, num_steps, n in configs():
        for _ in range(4):
            check_against_brute(rng, topk, num_steps, n, ties=True)
        ties_seen += topk > 1
    assert ties_seen


def test_ties_really_tie_children_with_parents():
    # Guards the tie test above: p = 1 makes a child's score equal its parent's.
    rng = np.random.default_rng(2)
    _, cands, _, _, _ = run_config(rng, 2, 5, 16, ties=True)
    scores, parents = cands.scores, cands.parents
    has_parent = parents >= 0
    parent_score = np.take_along_axis(scores, np.maximum(parents, 0), axis=1)
    assert np.all(scores[has_parent] <= parent_score[has_parent])
    assert np.any((scores == parent_score) & has_parent & (scores > 0))


def test_topk1_is_a_chain():
    rng = np.random.default_rng(3)
    for num_steps in (1, 3, 5):
        n = num_steps + 1
        (p0, t0, sp, st, root), _, _, tree, _ = run_config(rng, 1, num_steps, n)
        chain = np.concatenate([root[:, None], t0, st[:, :, 0, 0].T], axis=1)
        np.testing.assert_array_equal(tree.tokens, chain)
        np.testing.assert_array_equal(tree.parents, np.broadcast_to(np.arange(-1, n - 1), (BATCH, n)))
        np.testing.assert_array_equal(tree.depths, np.broadcast_to(np.arange(n), (BATCH, n)))
        np.testing.assert_array_equal(tree.mask, np.broadcast_to(np.tri(n, dtype=bool), (BATCH, n, n)))


def test_expand_beams_small_example():
    beam_scores = jnp.float32([[0.6, 0.3]])
    probs = jnp.float32([[[0.5, 0.4], [0.9, 0.1]]])
    tokens = jnp.int32([[[10, 11], [20, 21]]])
    step = expand_beams(beam_scores, probs, tokens)
    np.testing.assert_allclose(step.cand_scores, [[0.3, 0.24, 0.27, 0.03]], rtol=1e-6)
    np.testing.assert_array_equal(step.cand_tokens, [[10, 11, 20, 21]])
    np.testing.assert_array_equal(step.beam_cand, [[0, 2]])
    np.testing.assert_array_equal(step.beam_parent, [[0, 1]])
    np.testing.assert_array_equal(step.beam_tokens, [[10, 20]])
    np.testing.assert_allclose(step.beam_scores, [[0.3, 0.27]], rtol=1e-6)


def test_build_tree_rejects_too_many_nodes():
    scores = jnp.ones((1, 3))
    ids = jnp.zeros((1, 3), jnp.int32)
    try:
        build_tree(scores, ids, ids - 1, jnp.zeros((1,), jnp.int32), 5)
    except ValueError:
        return
    raise AssertionError("num_draft_tokens > candidates + 1 must raise")


def test_pipeline_lowers_for_cuda():
    # Runs inside the jitted decode step on the GPU: lower it for an abstract H200.
    topk, num_steps, n = 4, 5, 16
    spec = jax.ShapeDtypeStruct
    specs = (
        spec((BATCH, topk), jnp.float32),
        spec((BATCH, topk), jnp.int32),
        spec((num_steps - 1, BATCH, topk, topk), jnp.float32),
        spec((num_steps - 1, BATCH, topk, topk), jnp.int32),
        spec((BATCH,), jnp.int32),
        spec((BATCH, n), jnp.int32),
    )
    lowered = lower_for_cuda(pipeline(topk, num_steps, n), *specs)
    assert "stablehlo" in lowered.as_text()

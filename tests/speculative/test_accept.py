"""Greedy verification (jspec/speculative/accept.py) against a brute-force numpy walk.

Trees come from the same jitted draft -> build_tree -> greedy_accept pipeline
as test_tree.py (one compile per config, shared between the two files).
"""

from __future__ import annotations

import jax
import numpy as np
from support.tree import BATCH, VOCAB, configs, pipeline, random_draft


def run(topk, num_steps, n, draft, target):
    _, _, tree, acc = jax.tree.map(np.asarray, pipeline(topk, num_steps, n)(*draft, target))
    return tree, acc


def tree_of(rng, topk, num_steps, n, **draft_kw):
    draft = random_draft(rng, topk, num_steps, **draft_kw)
    tree, _ = run(topk, num_steps, n, draft, np.zeros((BATCH, n), np.int32))
    return draft, tree


def brute_walk(tokens, parents, target):
    """One request: follow the lowest-index child whose token is the target's argmax."""
    path = [0]
    while True:
        cur = path[-1]
        kids = [i for i in range(len(tokens)) if parents[i] == cur and tokens[i] == target[cur]]
        if not kids:
            break
        path.append(min(kids))
    emitted = [int(tokens[i]) for i in path[1:]] + [int(target[path[-1]])]
    return path, emitted


def check_accept(tree, acc, target, num_steps):
    width = num_steps + 1
    for b in range(BATCH):
        path, emitted = brute_walk(tree.tokens[b], tree.parents[b], target[b])
        m = len(path) - 1
        assert acc.accept_len[b] == m
        np.testing.assert_array_equal(acc.path[b], path + [-1] * (width - len(path)))
        np.testing.assert_array_equal(acc.tokens[b], emitted + [-1] * (width - len(emitted)))
        assert acc.bonus[b] == target[b, path[-1]]


def mostly_agreeing_target(rng, tree, vocab, agree=0.75):
    """At each node, with prob `agree`, the target picks one of the node's children's tokens."""
    b, n = tree.tokens.shape
    target = rng.integers(0, vocab, size=(b, n), dtype=np.int32)
    for r in range(b):
        for i in range(n):
            kids = np.flatnonzero(tree.parents[r] == i)
            if len(kids) and rng.random() < agree:
                target[r, i] = tree.tokens[r, rng.choice(kids)]
    return target


def test_greedy_accept_matches_brute_force():
    rng = np.random.default_rng(10)
    lengths = set()
    for topk, num_steps, n in configs():
        for _ in range(4):
            draft, tree = tree_of(rng, topk, num_steps, n)
            target = mostly_agreeing_target(rng, tree, VOCAB)
            tree, acc = run(topk, num_steps, n, draft, target)
            check_accept(tree, acc, target, num_steps)
            lengths.update(acc.accept_len.tolist())
    assert lengths == set(range(6)), lengths  # every accept length 0..5 was exercised


def test_duplicate_sibling_tokens_take_lowest_index():
    # A tiny vocabulary with replacement makes siblings share tokens, so several
    # children can match the target; the walk must take the lowest node index.
    rng = np.random.default_rng(11)
    for topk, num_steps, n in configs():
        if topk == 1:
            continue
        for _ in range(3):
            draft, tree = tree_of(rng, topk, num_steps, n, vocab=2, distinct=False)
            target = mostly_agreeing_target(rng, tree, 2)
            tree, acc = run(topk, num_steps, n, draft, target)
            check_accept(tree, acc, target, num_steps)


def test_target_agreeing_with_deepest_chain_accepts_it_all():
    rng = np.random.default_rng(12)
    for topk, num_steps, n in configs():
        draft, tree = tree_of(rng, topk, num_steps, n)
        target = rng.integers(0, VOCAB, size=(BATCH, n), dtype=np.int32)
        leaves = tree.depths.argmax(axis=1)  # lowest-index deepest node
        for b, leaf in enumerate(leaves):
            node = leaf
            while tree.parents[b, node] >= 0:
                target[b, tree.parents[b, node]] = tree.tokens[b, node]
                node = tree.parents[b, node]
        tree, acc = run(topk, num_steps, n, draft, target)
        depth = tree.depths[np.arange(BATCH), leaves]
        np.testing.assert_array_equal(acc.accept_len, depth)
        np.testing.assert_array_equal(acc.path[np.arange(BATCH), depth], leaves)
        np.testing.assert_array_equal(acc.bonus, target[np.arange(BATCH), leaves])
        if topk == 1:
            assert np.all(acc.accept_len == num_steps)
            np.testing.assert_array_equal(acc.path, np.broadcast_to(np.arange(n), (BATCH, n)))
            np.testing.assert_array_equal(acc.tokens[:, :-1], tree.tokens[:, 1:])
        check_accept(tree, acc, target, num_steps)


def test_target_disagreeing_at_root_accepts_nothing():
    rng = np.random.default_rng(13)
    for topk, num_steps, n in configs():
        draft, tree = tree_of(rng, topk, num_steps, n)
        # Every later node agrees with its first child, so only the root's miss stops the walk.
        target = np.where(tree.first_child >= 0, np.take_along_axis(tree.tokens, np.maximum(tree.first_child, 0), 1), 0)
        target[:, 0] = VOCAB + 1  # no draft token
        tree, acc = run(topk, num_steps, n, draft, target)
        assert np.all(acc.accept_len == 0)
        np.testing.assert_array_equal(acc.bonus, VOCAB + 1)
        pad = np.full((BATCH, num_steps), -1)
        np.testing.assert_array_equal(acc.path, np.concatenate([np.zeros((BATCH, 1), int), pad], 1))
        np.testing.assert_array_equal(acc.tokens, np.concatenate([np.full((BATCH, 1), VOCAB + 1), pad], 1))

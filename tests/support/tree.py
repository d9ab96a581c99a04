"""The draft-tree pipeline under test, one jitted program per static config, and random draft tables."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jspec.speculative import append_step, build_tree, candidate_count, expand_beams, greedy_accept, start_candidates

BATCH = 6

VOCAB = 97


def configs():
    """(topk, num_steps, num_draft_tokens) as the brief lists them."""
    out = []
    for topk in (1, 2, 4):
        for steps in (1, 3, 5):
            if topk == 1:
                out.append((topk, steps, steps + 1))
                continue
            cap = candidate_count(topk, steps) + 1
            for n in sorted({min(n, cap) for n in (2, 5, 8, 16)}):
                out.append((topk, steps, n))
    return out


@functools.cache
def pipeline(topk: int, num_steps: int, n: int):
    """Jitted draft bookkeeping + tree + greedy accept for one static config."""

    def run(p0, t0, step_probs, step_tokens, root, target):
        cands = start_candidates(p0, t0)
        steps = []
        for i in range(num_steps - 1):
            step = expand_beams(cands.beam_scores, step_probs[i], step_tokens[i])
            cands = append_step(cands, step)
            steps.append(step)
        tree = build_tree(cands.scores, cands.tokens, cands.parents, root, n)
        return cands, steps, tree, greedy_accept(tree, target, num_steps)

    # Tiny graphs: XLA's backend optimisation costs more compile time than it saves.
    return jax.jit(run, compiler_options={"xla_backend_optimization_level": 0})


def random_draft(rng, topk, num_steps, ties=False, vocab=VOCAB, distinct=True):
    """Per-step draft tables for BATCH requests: p0/t0 [B, topk], probs/tokens [S-1, B, topk, topk].

    Rows are sorted descending like a top-k. With ties, probabilities come from
    {1, .5, .25, 0} (exact in float32) so equal cumulative scores are common,
    including children equal to their parent (p = 1).
    """
    shape0, shape = (BATCH, topk), (max(num_steps - 1, 0), BATCH, topk, topk)

    def probs(s):
        if ties:
            p = rng.choice(np.float32([1.0, 0.5, 0.25, 0.0]), size=s)
        else:
            p = rng.dirichlet(np.ones(topk + 1), size=s[:-1])[..., :topk].astype(np.float32)
        return -np.sort(-p, axis=-1)

    def tokens(s):
        if not distinct:
            return rng.integers(0, vocab, size=s, dtype=np.int32)
        rows = [rng.permutation(vocab)[:topk] for _ in range(int(np.prod(s[:-1])))]
        return np.asarray(rows, np.int32).reshape(s)

    root = rng.integers(0, vocab, size=BATCH, dtype=np.int32)
    return probs(shape0), tokens(shape0), probs(shape), tokens(shape), root

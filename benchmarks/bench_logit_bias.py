"""What a request's logit_bias costs a step: the penalties' pass over [R, V] logits with the
sparse bias (layers/penalties.apply_penalties: up to MAX_LOGIT_BIAS_TOKENS pairs per slot,
scattered onto the row) against the penalties alone (the step before logit_bias) and against a
dense [slots + 1, V] bias gathered per row (the layout not taken), at decode rows and over a
verify tree's nodes (apply_tree_penalties). Every variant is checked against a numpy recompute
before it is timed. The bias pass runs in every step, biased requests or not.

    python -m benchmarks.bench_logit_bias [--rows 1,32,128,256] [--tiny] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import RESULTS_DIR, Results, timed
from jspec.config.sampling import MAX_LOGIT_BIAS_TOKENS, SamplingParams
from jspec.layers.penalties import (
    PenaltyState,
    _penalise,
    apply_penalties,
    apply_tree_penalties,
    logit_bias_rows,
)
from jspec.layers.sampling import sampling_rows


@jax.jit
def penalties_only(logits, state, slot_ids, params):
    return _penalise(
        logits.astype(jnp.float32), state.output_counts[slot_ids], state.prompt_seen[slot_ids], params[:, None, :]
    )


@jax.jit
def dense_bias(logits, state, slot_ids, params, bias):
    return penalties_only(logits, state, slot_ids, params) + bias[slot_ids]


def biased_state(slots: int, vocab: int, rng) -> tuple[PenaltyState, list[dict]]:
    """A penalty state whose every slot holds counts and a full logit_bias."""
    biases = [
        {
            int(t): float(v)
            for t, v in zip(
                rng.choice(vocab, MAX_LOGIT_BIAS_TOKENS, replace=False), rng.normal(size=MAX_LOGIT_BIAS_TOKENS)
            )
        }
        for _ in range(slots + 1)
    ]
    tokens, values = logit_bias_rows(biases, slots + 1, vocab)
    counts = rng.integers(0, 3, (slots + 1, vocab)).astype(np.int32)
    seen = rng.random((slots + 1, vocab)) < 0.05
    return PenaltyState(jnp.asarray(counts), jnp.asarray(seen), jnp.asarray(tokens), jnp.asarray(values)), biases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,32,128,256")
    ap.add_argument("--tree", default="32x8", help="B x N nodes of a verify tree ('' to skip)")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="the CPU dry run: a small vocabulary, few rows")
    ap.add_argument("--name", default="bench_logit_bias")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args()
    if args.tiny:
        args.rows, args.tree, args.vocab, args.iters = "1,4", "2x3", 512, 2
    rng = np.random.default_rng(0)
    row_counts = [int(r) for r in args.rows.split(",")]
    slots = max(row_counts)
    state, biases = biased_state(slots, args.vocab, rng)
    dense = np.zeros((slots + 1, args.vocab), np.float32)
    for s, b in enumerate(biases):
        dense[s, list(b)] = list(b.values())
    dense = jnp.asarray(dense)
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2)
    results = Results(
        args.out, args.name, {"vocab": args.vocab, "iters": args.iters, "bias_tokens": MAX_LOGIT_BIAS_TOKENS}
    )
    rows = []
    for R in row_counts:
        logits = jnp.asarray(rng.normal(size=(R, args.vocab)).astype(np.float32))
        slot_ids = jnp.asarray(rng.permutation(slots + 1)[:R].astype(np.int32))
        params = jnp.asarray(sampling_rows([sp] * R, [0] * R, R).params)
        base = np.asarray(penalties_only(logits, state, slot_ids, params))
        want = base + np.asarray(dense)[np.asarray(slot_ids)]
        variants = {
            "penalties_only": (functools.partial(penalties_only, logits, state, slot_ids, params), base),
            "sparse_bias": (functools.partial(jax.jit(apply_penalties), logits, state, slot_ids, params), want),
            "dense_bias": (functools.partial(dense_bias, logits, state, slot_ids, params, dense), want),
        }
        for name, (fn, expect) in variants.items():
            np.testing.assert_allclose(np.asarray(fn()), expect, rtol=1e-5, atol=1e-5, err_msg=name)
            ms = timed(fn, args.iters, 5) * 1e3
            rows.append(dict(case=f"decode R={R}", variant=name, ms=ms))
            print(f"decode R={R} {name}: {ms:.4f} ms", flush=True)
            results.write(rows=rows)
    if args.tree:
        B, N = (int(v) for v in args.tree.split("x"))
        logits = jnp.asarray(rng.normal(size=(B, N, args.vocab)).astype(np.float32))
        slot_ids = jnp.arange(B, dtype=jnp.int32)
        params = jnp.asarray(sampling_rows([sp] * B, [0] * B, B).params)
        tokens = jnp.asarray(rng.integers(0, args.vocab, (B, N)).astype(np.int32))
        mask = jnp.asarray(np.tril(np.ones((N, N), bool))[None].repeat(B, 0))  # a chain
        tree = jax.jit(apply_tree_penalties)
        no_bias = state._replace(bias_values=jnp.zeros_like(state.bias_values))
        got = np.asarray(tree(logits, state, slot_ids, params, tokens, mask))
        plain = np.asarray(tree(logits, no_bias, slot_ids, params, tokens, mask))
        np.testing.assert_allclose(got - plain, np.broadcast_to(np.asarray(dense)[:B, None], got.shape), atol=1e-5)
        for name, st in (("tree_penalties_unbiased", no_bias), ("tree_penalties_sparse_bias", state)):
            ms = timed(functools.partial(tree, logits, st, slot_ids, params, tokens, mask), args.iters, 5) * 1e3
            rows.append(dict(case=f"tree {B}x{N}", variant=name, ms=ms))
            print(f"tree {B}x{N} {name}: {ms:.4f} ms", flush=True)
            results.write(rows=rows)
    print(f"{'case':>16} {'variant':>28} {'ms':>9}")
    for r in rows:
        print(f"{r['case']:>16} {r['variant']:>28} {r['ms']:>9.4f}")


if __name__ == "__main__":
    main()

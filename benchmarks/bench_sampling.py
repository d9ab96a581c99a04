"""Sampling kernels alone: every way jspec can draw a token from [R, V] logits, timed side by side.

R = rows sampled per iteration (a verify samples after every node: B x num_draft_tokens rows),
V = Llama-3 vocabulary. Variants: the full-vocabulary sort that top-k / top-p used to need
(the baseline this replaces), mode "temperature" (no filter), mode "top_k" (thresholds among the
group-maximum candidates) and mode "filtered" (the threshold search: filtered/BITS per pass[/SPLITS per row]).
Each variant is checked against the sort before it is timed.

    python -m benchmarks.bench_sampling [--rows 32,128,256] [--name bench_sampling_kernels]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import RESULTS_DIR, Results, timed
from jspec.config.sampling import SamplingParams
from jspec.layers.sampling import (
    MIN_P,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    keep_mask,
    row_keys,
    sampling_rows,
)


def sort_keep_mask(x, params):
    """The replaced full-vocabulary sort, with the same keep rule (the baseline and the check)."""
    order = jnp.argsort(-x, axis=-1)
    sx = jnp.take_along_axis(x, order, axis=-1)
    p = jax.nn.softmax(sx, axis=-1)
    first = jax.vmap(lambda s: jnp.searchsorted(-s, -s, side="left"))(sx)  # first rank of each value
    mass = jnp.take_along_axis(jnp.cumsum(p, axis=-1) - p, first, axis=-1)
    k = params[:, TOP_K][:, None]
    keep = ((k <= 0) | (first < k)) & ((mass < params[:, TOP_P][:, None]) | (params[:, TOP_P][:, None] >= 1))
    keep &= sx - sx[:, :1] >= jnp.log(params[:, MIN_P])[:, None]
    inv = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(keep, inv, axis=-1)


@functools.partial(jax.jit, static_argnames=("variant",))
def draw(logits, params, seeds, positions, variant):
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(row_keys(seeds, positions))
    x = logits / params[:, TEMPERATURE][:, None]
    if variant == "sort":
        x = jnp.where(sort_keep_mask(x, params), x, -jnp.inf)
    elif variant.startswith("filtered"):  # filtered/BITS[/SPLITS]
        bits, splits = (int(v) for v in (variant.split("/")[1:] + ["1"])[:2])
        x = jnp.where(keep_mask(x, params, "filtered", bits, splits), x, -jnp.inf)
    elif variant == "top_k":
        x = jnp.where(keep_mask(x, params, "top_k"), x, -jnp.inf)
    return jnp.argmax(x + gumbel, axis=-1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="32,128,256")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", default="sort,temperature,top_k,filtered/1,filtered/2,filtered/4,filtered/8")
    ap.add_argument("--name", default="bench_sampling_kernels")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    filters = {
        "top-k 50 + top-p 0.95": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    }
    for R in [int(r) for r in args.rows.split(",")]:
        # Logits shaped like a trained LM's: a few strong candidates over a long tail.
        logits = jnp.asarray((rng.standard_t(3, size=(R, args.vocab)) * 2).astype(np.float32))
        positions = jnp.arange(R, dtype=jnp.int32)
        for fname, sp in filters.items():
            sr = jax.tree.map(jnp.asarray, sampling_rows([sp] * R, list(range(R)), R))
            variants = [v for v in args.variants.split(",") if v != "top_k" or sp.top_k > 0]
            want = np.asarray(draw(logits, sr.params, sr.seeds, positions, "sort"))
            for v in variants:
                got = np.asarray(draw(logits, sr.params, sr.seeds, positions, v))
                agree = float((got == want).mean())
                t = timed(functools.partial(draw, logits, sr.params, sr.seeds, positions, v), args.iters, 5)
                rows.append(dict(rows=R, vocab=args.vocab, filter=fname, variant=v, ms=t * 1e3, agree_with_sort=agree))
                print(f"R={R} {fname} {v}: {t * 1e3:.3f} ms agree {agree:.3f}", flush=True)
    Results(args.out, args.name, {"vocab": args.vocab, "iters": args.iters, "variants": args.variants}).write(rows=rows)
    print(f"{'R':>4} {'filter':>22} {'variant':>12} {'ms':>8} {'agree':>6}")
    for r in rows:
        print(f"{r['rows']:>4} {r['filter']:>22} {r['variant']:>12} {r['ms']:>8.3f} {r['agree_with_sort']:>6.3f}")


if __name__ == "__main__":
    main()

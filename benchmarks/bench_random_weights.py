"""Random weights (`--load-format dummy`, benchmarks' models): the first draw, compile included,
and a second, for a model shape's per-layer arrays.

A dummy-weight server pays the first draw at every cold start, before anything else compiles.

    python -m benchmarks.bench_random_weights [--shape smollm2-135m] [--dtype bfloat16] [--out DIR] [--tiny]

Run it in a fresh process with no persistent compilation cache (it turns none on): the first
call's time is then the compile's. --tiny: a 4-layer model of the small shape.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.common import RESULTS_DIR, Results, shape, tiny
from jspec.checkpoint.loader import param_shapes
from jspec.checkpoint.random_weights import random_weights


def timed_draw(shapes, dtype, seed: int) -> float:
    t = time.perf_counter()
    jax.block_until_ready(random_weights(shapes, jax.random.key(seed), dtype))
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model of the shape")
    args = ap.parse_args()
    cfg = tiny(shape(args.shape)) if args.tiny else shape(args.shape)
    shapes = param_shapes(cfg, True)
    dtype = jnp.dtype(args.dtype)
    first = timed_draw(shapes, dtype, 0)
    second = timed_draw(shapes, dtype, 1)
    tensors = len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    distinct = len({s for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))})
    settings = dict(shape=args.shape, tiny=args.tiny, dtype=args.dtype, layers=cfg.num_layers)
    path = Results(args.out, "bench_random_weights", settings).write(
        first_draw_s=first, second_draw_s=second, tensors=tensors, distinct_shapes=distinct
    )
    print(f"{args.shape}: {tensors} tensors of {distinct} shapes; first draw {first:.2f} s, second {second:.2f} s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Compile time of one decode program against model depth, scanned and unrolled layers.

The Llama-3.1-8B shape (benchmarks/shapes) lowered from abstract arrays (no weights are
made: compiling needs shapes only), its decode step at batch 1, compiled with every layer
(32) and with 2 layers, for the scanned layer loop (the default) and the per-layer unrolled
one. The scan's compile time should not grow with depth; the unrolled one's grows with it.
Each program compiles in a fresh process, so nothing is cached between them.

    python -m benchmarks.bench_compile_depth [--out benchmarks/results] [--shape llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import REPO_ROOT, RESULTS_DIR, Results, shape
from jspec.checkpoint.loader import param_shapes
from jspec.kvcache.pool import KVPool
from jspec.layers.penalties import init_penalty_state
from jspec.layers.sampling import sampling_rows
from jspec.steps.plain import PlainCarry, PlainState, plain_decode_step


def compile_once(name: str, layers: int, layer_loop: str) -> dict:
    """Lowers and compiles the plain decode step (batch 1) in this process; returns the times."""
    cfg = dataclasses.replace(shape(name), num_layers=layers)
    dtype = jnp.bfloat16
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )
    if layer_loop == "unrolled":
        params = {
            **params,
            "layers": [
                jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["layers"])
                for _ in range(layers)
            ],
        }
    pages, page_size, B = 2048, 16, 1
    kv = jax.ShapeDtypeStruct((layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim), dtype)
    state = PlainState(
        KVPool(kv, kv),
        PlainCarry(jax.ShapeDtypeStruct((B + 1,), jnp.int32), jax.ShapeDtypeStruct((B + 1,), jnp.int32)),
        jax.eval_shape(lambda: init_penalty_state(B, cfg.vocab_size)),
    )
    width = -(-cfg.max_position_embeddings // page_size)
    t0 = time.perf_counter()
    lowered = plain_decode_step.lower(
        params,
        state,
        jax.ShapeDtypeStruct((B,), jnp.int32),
        jax.ShapeDtypeStruct((B, width), jnp.int32),
        sampling_rows([], [], B),
        cfg=cfg,
        backend="reference",
        sampling="greedy",
    )
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return dict(shape=name, layers=layers, layer_loop=layer_loop, lower_s=t1 - t0, compile_s=t2 - t1, total_s=t2 - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--layer-loops", default="scan,unrolled")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, layers, loop = args.child
        print(json.dumps(compile_once(name, int(layers), loop)))
        return
    full = shape(args.shape).num_layers
    rows = []
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    for loop in args.layer_loops.split(","):
        for layers in (2, full):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_compile_depth", "--child", args.shape, str(layers), loop],
                env=env,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    by = {(r["layer_loop"], r["layers"]): r["total_s"] for r in rows}
    ratios = {loop: by[(loop, full)] / by[(loop, 2)] for loop in args.layer_loops.split(",")}
    settings = {"shape": args.shape, "batch": 1, "program": "plain decode step, greedy", "attention": "reference"}
    path = Results(args.out, "bench_compile_depth", settings).write(rows=rows, full_over_two_layers=ratios)
    print(f"wrote {path}\n")
    print(f"{'layer loop':>10} {'layers':>6} {'lower s':>8} {'compile s':>9} {'total s':>8}")
    for r in rows:
        print(
            f"{r['layer_loop']:>10} {r['layers']:>6} {r['lower_s']:>8.2f} {r['compile_s']:>9.2f} {r['total_s']:>8.2f}"
        )
    for loop, x in ratios.items():
        print(f"{loop}: {full} layers take {x:.2f}x the time of 2")


if __name__ == "__main__":
    main()

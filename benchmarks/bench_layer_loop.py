"""Stacked layers under lax.scan against per-layer weight arrays, on the GPU.

For each variant (a layer layout and the XLA flags it runs under, each in its own process so
the flags apply) and each model shape and batch: the plain decode step's device busy time
(profiler), its pipelined wall time per step, the host's dispatch time, the GPU idle fraction
under back-to-back dispatch, the compile time, and the weight-shaped copies in the optimized
HLO (a scanned weight sliced into a buffer of its own before its matmul).

    python -m benchmarks.bench_layer_loop [--out DIR] [--tiny] [--variants per_layer,scan,scan_dsf]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    Results,
    random_params,
    shape,
    timed,
    tiny,
)
from benchmarks.device_profile import profile_calls
from jspec.kvcache.pool import KVPool
from jspec.layers.penalties import init_penalty_state
from jspec.layers.sampling import sampling_rows
from jspec.models.common import UnrolledStack, unstack_layers
from jspec.steps.plain import PlainCarry, PlainState, plain_decode_step

DSF = "--xla_gpu_enable_dynamic_slice_fusion=true"
# Command buffers (CUDA graphs) with the layer loop's WHILE captured: the scan then launches as
# one graph instead of one host launch per kernel per layer.
WHILE_GRAPHS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
# cuBLAS for every dot: dynamic-slice fusion rewrites cuBLAS calls only, not Triton GEMM fusions.
CUBLAS = "--xla_gpu_enable_triton_gemm=false"
VARIANTS = {  # name: (layer layout, XLA flags, extra environment)
    "per_layer": ("per_layer", "", {}),
    # Stacked weights, the loop unrolled over static slices: few arguments, no scan.
    "stacked_unrolled": ("stacked_unrolled", "", {}),
    "scan": ("scan", "", {}),
    "scan_dsf": ("scan", DSF, {}),
    "scan_dsf_graphs": ("scan", f"{DSF} {WHILE_GRAPHS}", {}),
    "per_layer_cublas": ("per_layer", CUBLAS, {}),
    "scan_dsf_cublas": ("scan", f"{DSF} {CUBLAS}", {}),
    "scan_dsf_pallas_gemv": ("scan", DSF, {"JSPEC_SKINNY_MATMUL": "pallas"}),
}


def weight_copies(hlo: str, shapes: set[str]) -> dict:
    """Ops in the optimized HLO whose result is a per-layer weight's shape and that write it
    (copies, dynamic slices, loop fusions): each is a weight materialised before its use."""
    n, ops, examples = 0, {}, []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w\-]+)\(", line)
        if not m:
            continue
        dims = [d for d in m.group(2).split(",") if d]
        while dims and dims[0] == "1":  # a [1, in, out] slice is the same bytes
            dims = dims[1:]
        if f"{m.group(1)}[{','.join(dims)}]" not in shapes:
            continue
        op = m.group(3)
        if op in ("parameter", "get-tuple-element", "bitcast", "tuple", "constant"):
            continue
        n += 1
        ops[op] = ops.get(op, 0) + 1
        if len(examples) < 6:
            examples.append(line.strip()[:300])
    return {"count": n, "ops": ops, "examples": examples}


def child(variant: str, dry_run: bool) -> list[dict]:
    shapes = [(s, 1024) for s in os.environ.get("BENCH_SHAPES", "llama-3.1-8b,smollm2-135m").split(",")]
    batches = tuple(int(b) for b in os.environ.get("BENCH_BATCHES", "1,16,64").split(","))
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    rows = []
    for name, ctx in shapes:
        cfg = shape(name)
        if dry_run:
            cfg, ctx, batches = tiny(cfg, num_layers=3), 64, (1, 4)
        rows += shape_rows(variant, name, cfg, ctx, batches, dtype)
    return rows


def shape_rows(variant: str, name: str, cfg, ctx: int, batches, dtype) -> list[dict]:
    """One model shape's rows, every batch size; its weights and pool are freed on return."""
    layout = VARIANTS[variant][0]
    rows = []
    params = random_params(cfg, dtype)
    hlo_dtype = {"float32": "f32", "bfloat16": "bf16"}[jnp.dtype(dtype).name]
    per_layer_shapes = {
        f"{hlo_dtype}[{','.join(map(str, v.shape[1:]))}]" for v in params["layers"].values() if v.ndim >= 3
    }
    weights = unstack_layers(params) if layout == "per_layer" else params
    if layout == "stacked_unrolled":
        weights = {**params, "layers": UnrolledStack(params["layers"])}
    if layout == "per_layer":
        del params
    S = 16
    per_seq = (ctx + 128) // S
    num_pages = max(batches) * per_seq + 2
    kv_shape = (cfg.num_layers, num_pages, S, cfg.num_kv_heads, cfg.head_dim)
    fill = jax.jit(
        lambda k: jax.lax.map(lambda kk: jax.random.normal(kk, kv_shape[1:], dtype), jax.random.split(k, kv_shape[0]))
    )
    kv = KVPool(fill(jax.random.key(10)), fill(jax.random.key(11)))
    rng = np.random.default_rng(0)
    for B in batches:
        pages = rng.permutation(np.arange(1, num_pages))[: B * per_seq].reshape(B, per_seq)
        slot_ids = jnp.arange(B, dtype=jnp.int32)
        page_tables = jnp.asarray(pages, jnp.int32)
        greedy = jax.tree.map(jnp.asarray, sampling_rows([], [], B))
        carry = PlainCarry(
            jnp.asarray(rng.integers(0, cfg.vocab_size, B + 1), jnp.int32),
            jnp.full(B + 1, ctx - 64, jnp.int32).at[B].set(0),
        )
        state = {"s": PlainState(kv, carry, init_penalty_state(B, cfg.vocab_size))}

        def step():
            state["s"], out = plain_decode_step(
                weights, state["s"], slot_ids, page_tables, greedy, cfg=cfg, sampling="greedy"
            )
            return out.ints

        t0 = time.perf_counter()
        hlo = (
            plain_decode_step.lower(weights, state["s"], slot_ids, page_tables, greedy, cfg=cfg, sampling="greedy")
            .compile()
            .as_text()
        )
        compile_s = time.perf_counter() - t0
        if os.environ.get("BENCH_DUMP_HLO") and B == batches[0]:
            with open(os.path.join(os.environ["BENCH_DUMP_HLO"], f"hlo_{variant}_{name}_b{B}.txt"), "w") as f:
                f.write(hlo)
        jax.block_until_ready(step())
        wall = timed(step, 20, 3)
        # Host dispatch alone: a few launches back to back, not waited for.
        jax.block_until_ready(step())
        t0 = time.perf_counter()
        for _ in range(10):
            out = step()
        launch = (time.perf_counter() - t0) / 10
        jax.block_until_ready(out)
        prof = profile_calls(step, calls=5)
        kv = state["s"].target_kv
        busy = prof.get("busy_us", float("nan")) / 1e3
        row = dict(
            variant=variant,
            layout=layout,
            shape=name,
            batch=B,
            context=ctx,
            compile_s=compile_s,
            wall_ms=wall * 1e3,
            launch_ms=launch * 1e3,
            weight_arguments=len(jax.tree.leaves(weights)),
            device_busy_ms=busy,
            gpu_idle=1 - busy / (wall * 1e3) if not np.isnan(busy) else None,
            kernels=prof.get("kernels"),
            weight_copies=weight_copies(hlo, per_layer_shapes),
            by_kind=prof.get("by_kind"),
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script")
    ap.add_argument("--variants", default="per_layer,scan,scan_dsf,scan_dsf_graphs")
    ap.add_argument("--name", default="bench_layer_loop", help="the JSON's file name under --out")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with open(os.environ["JSPEC_CHILD_OUT"], "w") as f:
            json.dump(child(args.child, args.tiny), f)
        return
    rows, failures = [], {}
    for v in args.variants.split(","):
        env = dict(os.environ, **VARIANTS[v][2])
        flags = VARIANTS[v][1]
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        env["JSPEC_CHILD_OUT"] = out_file = f"/tmp/bench_layer_loop_{v}.json"
        cmd = [sys.executable, "-m", "benchmarks.bench_layer_loop", "--child", v] + (["--tiny"] if args.tiny else [])
        r = subprocess.run(cmd, env=env, cwd=REPO_ROOT, check=False)  # a failed variant is recorded, not fatal
        if r.returncode == 0:
            with open(out_file) as f:
                rows += json.load(f)
        else:
            failures[v] = r.returncode
    settings = {
        "tiny": args.tiny,
        "variants": args.variants,
        "flags": {v: VARIANTS[v][1:] for v in VARIANTS},
        "shapes": os.environ.get("BENCH_SHAPES"),
        "batches": os.environ.get("BENCH_BATCHES"),
    }
    path = Results(args.out, "bench_layer_loop", settings, file_name=args.name).write(rows=rows, failures=failures)
    print(f"\nwrote {path}")
    print(
        f"{'variant':>10} {'shape':>14} {'B':>3} {'busy ms':>8} {'wall ms':>8} {'launch':>7} {'idle':>5} "
        f"{'kern':>5} {'wcopies':>7} {'compile':>7}"
    )
    for r in rows:
        print(
            f"{r['variant']:>10} {r['shape']:>14} {r['batch']:>3} {r['device_busy_ms']:>8.3f} {r['wall_ms']:>8.3f} "
            f"{r['launch_ms']:>7.3f} {r['gpu_idle'] or 0:>5.2f} {r['kernels'] or 0:>5} "
            f"{r['weight_copies']['count']:>7} {r['compile_s']:>7.1f}"
        )
    if failures:
        print("failed:", failures)


if __name__ == "__main__":
    main()

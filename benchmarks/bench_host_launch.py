"""Host time to launch one decode iteration, on whatever backend runs it (the CPU here).

For the SmolLM2-135M shape (random weights) at batch 1, plain decoding and EAGLE-3 (3,1,4)
with a random head:
- launch with the device idle: worker.decode (input arrays + dispatch) after the previous
  step finished, split into building the inputs and dispatching the program; and again with
  the last two steps' outputs kept alive, as the overlap loop keeps them (their memory is not
  reused, so each step's outputs move and XLA updates its command buffers first);
- the same dispatch for a trivial program with the step's argument tree (what the call
  mechanism alone costs for these leaves);
- inside the overlap loop: the engine's schedule / launch / process / wait split per iteration;
- a cProfile of the loop's launches: where the launch's host time goes;
- --trace: the same loop under JAX's profiler, the host's self time per XLA runtime event (the
  executable's launch, its thunks, command-buffer updates) and the device's kernels, per
  iteration: where the launch goes below the Python call (benchmarks/device_profile.py).

    python -m benchmarks.bench_host_launch [--out benchmarks/results] [--tiny] [--methods none,eagle3]
        [--attention-backend pallas|mosaic] [--trace]

The settings record XLA_FLAGS and XLA_PYTHON_CLIENT_ALLOCATOR: run it once with
`--xla_gpu_enable_command_buffer=` to see what XLA's command buffers (CUDA graphs) save the
launch, per attention backend, or under another allocator or command-buffer update mode; each
row keeps the tokens it generated, so two runs can be checked for the same output.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (
    RESULTS_DIR,
    SMALL,
    SMALL_DRAFT,
    TINY,
    TINY_DRAFT,
    Results,
    median_ms,
    random_params,
)
from benchmarks.device_profile import device_summary, host_self_times, trace_calls
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.engine.engine import LoopTimes
from jspec.worker.base import check_layer_loop
from jspec.worker.inputs import decode_inputs


def idle_launch(engine) -> dict:
    """Launches with the device idle: the previous step is waited for before each timed one."""
    w, kv = engine.worker, engine.scheduler.kv
    slot = kv.alloc_slot()
    pages = [kv.allocator.alloc(8)]
    greedy = [(jspec.SamplingParams(), 0)]

    def wait():
        jax.block_until_ready(w.state)

    full = median_ms(lambda: w.decode([slot], pages, greedy), 50, wait)
    # The same with the last two steps' outputs kept alive, as the overlap loop keeps them until
    # it reads them: each step's outputs then land at a new address (the dropped ones' memory is
    # reused above), and XLA updates its command buffers before the launch.
    kept = []

    def launch_keeping_outputs():
        kept.append(w.decode([slot], pages, greedy))
        del kept[:-2]

    full_kept = median_ms(launch_keeping_outputs, 50, wait)
    kept.clear()
    inputs = median_ms(lambda: decode_inputs(w, [slot], pages, greedy), 200)
    built = decode_inputs(w, [slot], pages, greedy)
    dispatch = median_ms(lambda: w.decode_arrays(*built, "greedy"), 50, wait)
    # The call mechanism alone: a program that only passes the donated state through.
    passthrough = jax.jit(lambda params, state, *rest: state, donate_argnums=1)
    args = (w.params, w.state, *built)
    state = {"s": passthrough(*args)}
    w.state = None

    def call():
        state["s"] = passthrough(w.params, state["s"], *built)

    floor = median_ms(call, 200, lambda: jax.block_until_ready(state["s"]))
    # The same with the weights as one small array: what the weights' leaves alone cost a call.
    one_leaf = jnp.zeros(8, w.dtype)

    def call_without_weights():
        state["s"] = passthrough(one_leaf, state["s"], *built)

    call_without_weights()
    floor_one = median_ms(call_without_weights, 200, lambda: jax.block_until_ready(state["s"]))
    w.state = state["s"]
    jax.block_until_ready(w.decode([slot], pages, greedy))
    kv.free_slot(slot)
    kv.allocator.free(pages[0])
    return dict(
        launch_ms=full,
        launch_outputs_kept_ms=full_kept,
        inputs_ms=inputs,
        dispatch_ms=dispatch,
        passthrough_dispatch_ms=floor,
        passthrough_weights_as_one_leaf_ms=floor_one,
        argument_leaves=len(jax.tree.leaves(args)),
        weight_leaves=len(jax.tree.leaves(w.params)),
        us_per_weight_leaf=1e3 * (floor - floor_one) / max(len(jax.tree.leaves(w.params)) - 1, 1),
    )


def loop_split(engine, tokens: int) -> tuple[dict, dict, str, list[int]]:
    """One request generating `tokens` under the overlap loop: host time per iteration by phase
    (mean and median), then the same run again under cProfile for a profile of the launches;
    last, the tokens the request generated."""
    params = jspec.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    # Compiles what this workload needs; its tokens let runs under other runtime settings
    # (allocators, command-buffer modes) be checked for the same output.
    first = engine.generate([[1, 2, 3, 4]], params)[0].token_ids
    engine.loop_times = LoopTimes()
    launches = []
    launch = engine._launch

    def timed(batch):
        t0 = time.perf_counter()
        try:
            return launch(batch)
        finally:
            launches.append(time.perf_counter() - t0)

    engine._launch = timed
    try:
        engine.generate([[1, 2, 3, 4]], params)
    finally:
        engine._launch = launch
    split = engine.loop_times.per_iteration_ms()
    medians = dict(launch=float(np.median(launches)) * 1e3, launch_p90=float(np.percentile(launches, 90)) * 1e3)
    prof = cProfile.Profile()

    def profiled(batch):
        prof.enable()
        try:
            return launch(batch)
        finally:
            prof.disable()

    engine._launch = profiled
    try:
        engine.generate([[1, 2, 3, 4]], params)
    finally:
        engine._launch = launch
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    return split, medians, out.getvalue(), list(map(int, first))


def loop_trace(engine, tokens: int) -> dict:
    """One request of `tokens` under the overlap loop, traced: host self time per runtime event
    and the device's kernels, both per iteration."""
    params = jspec.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    trace = trace_calls(lambda: engine.generate([[1, 2, 3, 4]], params), calls=1)
    if trace is None:
        return {"error": "no trace written"}
    return dict(host=host_self_times(trace, tokens), device=device_summary(trace, tokens))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a quick dry run of the script")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--name", default="bench_host_launch", help="the JSON's name (a GPU run: bench_host_launch_gpu)")
    ap.add_argument("--methods", default="none,eagle3", help="of none, eagle3")
    ap.add_argument("--attention-backend", default=None, help="the engine's (default: the engine's own default)")
    ap.add_argument("--trace", action="store_true", help="also trace the loop (host runtime events, device kernels)")
    args = ap.parse_args()
    cfg, dcfg = (TINY, TINY_DRAFT) if args.tiny else (SMALL, SMALL_DRAFT)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    params = random_params(cfg, dtype)
    dparams = init_random_draft_params(dcfg, jax.random.key(3), dtype)
    rows = []
    for method in args.methods.split(","):
        spec = None if method == "none" else jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1)
        engine = jspec.Engine(
            (cfg, params),
            speculative=spec,
            draft=(dcfg, dparams) if spec else None,
            page_size=16,
            max_running_requests=4,
            disable_radix_cache=True,
            attention_backend=args.attention_backend,
        )
        split, medians, profile, generated = loop_split(engine, args.tokens)
        row = dict(
            method=method,
            batch=1,
            idle=idle_launch(engine),
            overlap_loop_ms=split,
            overlap_launch_median_ms=medians,
            launch_profile=profile,
            generated_tokens=generated,
        )
        if args.trace:
            row["loop_trace"] = loop_trace(engine, args.tokens)
            host = row["loop_trace"].get("host", {}).get("self_us_per_call", {})
            print(f"[{method}] host self time per iteration (us), the largest runtime events:")
            for name, us in list(host.items())[:12]:
                print(f"  {us:>9.1f}  {name[:100]}")
        rows.append(row)
        print(profile)
    settings = {
        "model": "tiny" if args.tiny else "smollm2-135m shape",
        "dtype": str(jnp.dtype(dtype)),
        "batch": 1,
        "methods": args.methods,
        "speculative": "EAGLE3 (3,1,4), random head" if "eagle3" in args.methods else None,
        "tokens": args.tokens,
        "layer_loop": check_layer_loop("auto"),
        "attention_backend": args.attention_backend or "default",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
    }
    path = Results(args.out, args.name, settings).write(rows=rows)
    print(f"wrote {path}\n")
    print(
        f"{'method':>7} {'idle launch':>11} {'kept':>6} {'inputs':>7} {'dispatch':>8} {'floor':>6} {'1 leaf':>6} "
        f"{'leaves':>6} {'us/leaf':>7} | loop: {'sched':>6} "
        f"{'launch':>6} {'median':>6} {'p90':>6} {'process':>7} {'wait':>7}  (ms per iteration)"
    )
    for r in rows:
        i, lp, m = r["idle"], r["overlap_loop_ms"], r["overlap_launch_median_ms"]
        print(
            f"{r['method']:>7} {i['launch_ms']:>11.3f} {i['launch_outputs_kept_ms']:>6.3f} {i['inputs_ms']:>7.3f} "
            f"{i['dispatch_ms']:>8.3f} "
            f"{i['passthrough_dispatch_ms']:>6.3f} {i['passthrough_weights_as_one_leaf_ms']:>6.3f} "
            f"{i['weight_leaves']:>6} {i['us_per_weight_leaf']:>7.2f} | {lp['schedule']:>11.3f} {lp['launch']:>6.3f} "
            f"{m['launch']:>6.3f} {m['launch_p90']:>6.3f} {lp['process']:>7.3f} {lp['wait']:>7.3f}"
        )


if __name__ == "__main__":
    main()

"""Overlap scheduler vs synchronous loop on the GPU: output tokens/s and GPU idle fraction.

For each model shape, batch size and method (no spec / EAGLE-3 with a random
head), the same workload (B requests, 128-token prompts, 128 new tokens,
ignore_eos) runs through the Engine twice untimed (compiles everything it
needs), then timed once with the overlap loop and once synchronously.

GPU idle fraction = 1 - device busy / wall, where device busy is the time of
the same compiled decode step run back to back (the step the loop launches
most). The overlap run is wrapped in jax.transfer_guard_device_to_host
("disallow"): it fails if the loop reads the device anywhere but its one
designated point.

    python -m benchmarks.bench_overlap [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (
    EAGLE3_8B_CTX,
    LLAMA_8B_CTX,
    RESULTS_DIR,
    SMALL,
    SMALL_DRAFT,
    TINY,
    TINY_DRAFT,
    HeldDecode,
    Results,
    int_list,
    random_params,
)
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.engine.engine import LoopTimes


def run_workload(engine, B, prompt_len, new_tokens, seed):
    rng = np.random.default_rng(seed)
    params = jspec.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for _ in range(B):
        engine.add_request(list(map(int, rng.integers(0, 500, prompt_len))), dataclasses.replace(params))
    steps = 0
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script itself")
    ap.add_argument("--models", default="small,8b", help="which of small,8b")
    ap.add_argument("--batches", type=int_list, help="e.g. 1,16,64")
    ap.add_argument("--name", default="bench_overlap", help="JSON file name under --out")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    prompt_len, new_tokens = 128, 128
    cases = [("small", SMALL, SMALL_DRAFT, [1, 16, 64]), ("8b", LLAMA_8B_CTX, EAGLE3_8B_CTX, [1, 16, 64])]
    cases = [(n, c, d, args.batches or b) for n, c, d, b in cases if n in args.models.split(",")]
    if args.quick:
        cases = [("small", SMALL, SMALL_DRAFT, [1, 16])]
    if args.tiny:
        cases, prompt_len, new_tokens = [("tiny", TINY, TINY_DRAFT, args.batches or [1, 4])], 16, 8
    rows = []
    results = Results(
        args.out,
        "bench_overlap",
        {"prompt_len": prompt_len, "new_tokens": new_tokens, "page_size": 16, "speculative": "EAGLE3 (3,1,4)"},
        file_name=args.name,
    )

    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    for name, cfg, dcfg, batches in cases:
        params = random_params(cfg, dtype)
        dparams = init_random_draft_params(dcfg, jax.random.key(3), dtype)
        for method in ("none", "eagle3"):
            spec = None if method == "none" else jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1)
            for B in batches:
                row = dict(model=name, method=method, batch=B)
                for overlap in (True, False):
                    engine = jspec.Engine(
                        (cfg, params),
                        speculative=spec,
                        draft=(dcfg, dparams) if spec else None,
                        page_size=16,
                        max_running_requests=max(B, 1),
                        max_total_tokens=B * (prompt_len + new_tokens + 64) + 1024,
                        disable_overlap_schedule=not overlap,
                        disable_radix_cache=True,
                    )
                    for seed in (0, 1):  # untimed: compile every shape this workload meets
                        run_workload(engine, B, prompt_len, new_tokens, seed)
                    guard = "disallow" if overlap and not args.tiny else "allow"
                    engine.loop_times = LoopTimes()
                    with jax.transfer_guard_device_to_host(guard):
                        wall, steps = run_workload(engine, B, prompt_len, new_tokens, 2)
                    engine.check_idle_no_leaks()
                    key = "overlap" if overlap else "sync"
                    row[f"{key}_tok_per_s"] = B * new_tokens / wall
                    row[f"{key}_step_ms"] = wall / steps * 1e3
                    # Host time per iteration (schedule + launch + process, not the wait): what
                    # the overlap loop hides behind the device step.
                    row[f"{key}_host_ms"] = engine.loop_times.per_iteration_ms()
                # Device busy per decode step: the same compiled step on prebuilt inputs, back to back
                # (no host work between launches), at the workload's mid-generation context.
                with HeldDecode(
                    engine, B, -(-(prompt_len + new_tokens + 64) // 16), prompt_len + new_tokens // 2
                ) as held:
                    busy = held.step_ms() / 1e3
                emitted_per_step = 1.0  # random heads accept ~nothing: one token per decode step
                row["device_step_ms"] = busy * 1e3
                decode_steps = new_tokens / emitted_per_step
                for key_ in ("overlap", "sync"):
                    wall_total = B * new_tokens / row[f"{key_}_tok_per_s"]
                    row[f"{key_}_gpu_idle"] = max(0.0, 1 - decode_steps * busy / wall_total)
                row["overlap_speedup"] = row["overlap_tok_per_s"] / row["sync_tok_per_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                results.write(rows=rows)
    path = results.write(rows=rows)
    print(f"\nwrote {path}\n")
    print(
        f"{'model':>6} {'method':>7} {'B':>3} {'overlap tok/s':>13} {'sync tok/s':>10} {'x':>5} "
        f"{'idle ovl':>8} {'idle sync':>9} {'dev ms':>7} {'host ms':>7} {'sched':>6} {'launch':>6} {'proc':>6}"
    )
    for r in rows:
        h = r["overlap_host_ms"]
        print(
            f"{r['model']:>6} {r['method']:>7} {r['batch']:>3} {r['overlap_tok_per_s']:>13.0f} "
            f"{r['sync_tok_per_s']:>10.0f} {r['overlap_speedup']:>5.2f} {r['overlap_gpu_idle']:>8.1%} "
            f"{r['sync_gpu_idle']:>9.1%} {r['device_step_ms']:>7.3f} {h['host']:>7.3f} {h['schedule']:>6.3f} "
            f"{h['launch']:>6.3f} {h['process']:>6.3f}"
        )


if __name__ == "__main__":
    main()

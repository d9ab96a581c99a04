"""Python's garbage collections in a serving engine's process, with its start-up heap frozen
(the default: engine/heap.py) and without (`--disable-gc-freeze`).

Each variant runs in a fresh process: the embedded demo model's engine, warmed up as a server's
is, then `--rounds` rounds of `--prompts` chat prompts generating `--tokens` tokens each through
the overlap loop, while gc.callbacks time every collection. Reported per variant: collections
and their longest pause per generation, the workload's wall time, and what one full collection
of the process's heap costs after the workload (what an automatic oldest-generation collection
would stall the loop for).

    python -m benchmarks.bench_gc [--rounds 6] [--prompts 32] [--tokens 48] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

from benchmarks.common import RESULTS_DIR, Results

VARIANTS = ("python_default", "frozen")


def run_variant(variant: str, rounds: int, prompts: int, tokens: int) -> dict:
    import jspec
    from jspec.checkpoint.demo import default_model_path
    from jspec.engine.heap import GcPauses, settle_heap

    path, what = default_model_path()
    engine = jspec.Engine(path)
    engine.warmup()
    settle_heap("bench_gc", freeze=variant == "frozen")  # as a serving process does, either way
    frozen = gc.get_freeze_count()
    params = jspec.SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    round_s = []
    with GcPauses() as pauses:
        for r in range(rounds):
            texts = [f"Request {r}-{i}: tell me about the number {r * prompts + i}." for i in range(prompts)]
            t0 = time.perf_counter()
            engine.generate(texts, params)
            round_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    gc.collect()
    full_collect_ms = (time.perf_counter() - t0) * 1e3
    return {
        "variant": variant,
        "model": what,
        "frozen_objects": frozen,
        "tracked_objects_after": len(gc.get_objects()),
        "collections": pauses.count,
        "collection_ms_total": [round(x, 3) for x in pauses.total_ms],
        "collection_ms_max": [round(x, 3) for x in pauses.max_ms],
        "round_s": [round(x, 3) for x in round_s],
        "full_collect_ms_after": round(full_collect_ms, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--variant", choices=VARIANTS, help="run one variant here and print its row (internal)")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.rounds, args.prompts, args.tokens)))
        return
    settings = dict(rounds=args.rounds, prompts=args.prompts, tokens=args.tokens)
    results = Results(args.out, "bench_gc", settings, device="CPU (the engine process's host side)")
    rows = []
    for variant in VARIANTS:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_gc", "--variant", variant]
            + [f"--{k}={v}" for k, v in settings.items()],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        results.write(rows=rows)
    print(
        f"{'variant':>15} {'gen0/1/2 collections':>22} {'longest ms (0/1/2)':>24} {'full collect ms':>16} {'rounds s':>9}"
    )
    for r in rows:
        counts = "/".join(map(str, r["collections"]))
        longest = "/".join(f"{x:.2f}" for x in r["collection_ms_max"])
        print(
            f"{r['variant']:>15} {counts:>22} {longest:>24} {r['full_collect_ms_after']:>16.1f} {sum(r['round_s']):>9.1f}"
        )
    print(results.path)


if __name__ == "__main__":
    main()

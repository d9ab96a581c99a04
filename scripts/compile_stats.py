"""Where the test suite's compile time goes, by test file, from a run with
JSPEC_TEST_COMPILE_STATS=PREFIX (tests/conftest.py writes PREFIX.<worker>.json per worker).

    JSPEC_TEST_COMPILE_STATS=/tmp/cs bash scripts/run_tests.sh
    .venv/bin/python scripts/compile_stats.py /tmp/cs [--top 30]
"""

from __future__ import annotations

import argparse
import glob
import json

BACKEND = "/jax/core/compile/backend_compile_duration"
HITS = "/jax/compilation_cache/cache_hits"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def merged(prefix: str) -> dict[str, dict[str, tuple[int, float]]]:
    by_file: dict[str, dict[str, tuple[int, float]]] = {}
    for path in sorted(glob.glob(f"{prefix}.*.json")):
        with open(path) as f:
            for name, events in json.load(f).items():
                per = by_file.setdefault(name, {})
                for event, (count, seconds) in events.items():
                    c, s = per.get(event, (0, 0.0))
                    per[event] = (c + count, s + seconds)
    return by_file


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefix")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    by_file = merged(args.prefix)
    if not by_file:
        raise SystemExit(f"no {args.prefix}.*.json: run the suite with JSPEC_TEST_COMPILE_STATS={args.prefix}")
    rows = sorted(by_file.items(), key=lambda kv: -kv[1].get(BACKEND, (0, 0.0))[1])
    print(f"{'test file':<40} {'compiles':>8} {'compile s':>10} {'cache hits':>10} {'trace s':>8} {'lower s':>8}")
    total = [0, 0.0, 0, 0.0, 0.0]
    for rank, (name, ev) in enumerate(rows):
        n, secs = ev.get(BACKEND, (0, 0.0))
        hits = ev.get(HITS, (0, 0.0))[0]
        trace, lower = ev.get(TRACE, (0, 0.0))[1], ev.get(LOWER, (0, 0.0))[1]
        for i, v in enumerate((n, secs, hits, trace, lower)):
            total[i] += v
        if rank < args.top:
            print(f"{name:<40} {n:>8} {secs:>10.1f} {hits:>10} {trace:>8.1f} {lower:>8.1f}")
    n, secs, hits, trace, lower = total
    print(f"{'all ' + str(len(rows)) + ' files':<40} {n:>8} {secs:>10.1f} {hits:>10} {trace:>8.1f} {lower:>8.1f}")


if __name__ == "__main__":
    main()

"""The overlap loop's host time per decode iteration against the running requests: schedule,
launch and process (token bookkeeping, detokenizing, stop checks, outputs) in milliseconds per
iteration and per row, on a tiny model with a tokenizer (its device step is what the backend
makes of it; the host figures are what matter here), plus the process phase's top functions
at the largest row count.

    python -m benchmarks.bench_host_rows [--rows 1,16,64,256] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import tempfile

import numpy as np

import jspec
from benchmarks.common import RESULTS_DIR, Results
from jspec.checkpoint.tiny import make_tiny_model
from jspec.engine.engine import LoopTimes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def decode_iterations(engine, rows: int, iterations: int, profile: bool = False):
    """Runs `rows` requests past their prefill, then times `iterations` decode steps."""
    rng = np.random.default_rng(rows)
    for _ in range(rows):
        prompt = list(map(int, rng.integers(0, 200, 64)))
        engine.add_request(prompt, jspec.SamplingParams(max_new_tokens=iterations + 16, ignore_eos=True))
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    for _ in range(3):
        engine.step()
    engine.loop_times = LoopTimes()
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    for _ in range(iterations):
        engine.step()
    if prof is not None:
        prof.disable()
    times = engine.loop_times.per_iteration_ms()
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    engine.drain()
    return times, prof


def tiny_model(tokenizer_from: str | None) -> str:
    path = tempfile.mkdtemp() + "/m"
    if tokenizer_from is None:
        return make_tiny_model(path)
    vocab = json.load(open(os.path.join(tokenizer_from, "config.json")))["vocab_size"]
    make_tiny_model(path, vocab_size=vocab, tokenizer=False)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_from, name)):
            shutil.copy(os.path.join(tokenizer_from, name), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--name", default="bench_host_rows")
    ap.add_argument(
        "--tokenizer-from",
        metavar="DIR",
        help="a checkpoint whose tokenizer the tiny model takes (its vocabulary too): a real BPE's "
        "detokenizing cost instead of the byte tokenizer's",
    )
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    model = jspec.load(tiny_model(a.tokenizer_from))
    engine = jspec.Engine(
        model, max_running_requests=max(rows), max_total_tokens=max(rows) * 256, precompile_bs_paddings=rows
    )
    results = Results(a.out, a.name, vars(a))
    table = []
    for n in rows:
        times, _ = decode_iterations(engine, n, a.iterations)
        table.append({"rows": n, **times, "process_per_row_us": 1e3 * times["process"] / n})
        print(
            f"rows {n:>4}: schedule {times['schedule']:.2f} ms, launch {times['launch']:.2f} ms, "
            f"process {times['process']:.2f} ms ({1e3 * times['process'] / n:.0f} us a row), wait {times['wait']:.2f} ms",
            flush=True,
        )
        results.write(rows=table)
    _, prof = decode_iterations(engine, rows[-1], a.iterations // 2, profile=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    results.write(rows=table, profile_at_largest=text.getvalue().splitlines()[-24:])
    print(text.getvalue())


if __name__ == "__main__":
    main()

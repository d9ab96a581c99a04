"""What the first steps over a new KV pool allocate: the step program's expected formats
(layout and sharding) of the pool's leaves against the leaves' own, and the device memory in
use and at its peak after each of the first steps (benchmarks/NOTES.md, "The KV pool on the GPU").

    python -m benchmarks.first_step_memory --model-path benchmarks/shapes/llama-3.1-8b --max-total-tokens 100000
"""

from __future__ import annotations

import argparse
import os

import jax

import jspec
from benchmarks.common import Results
from jspec.config.load import LoadConfig
from jspec.config.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="benchmarks/shapes/llama-3.1-8b")
    ap.add_argument("--max-total-tokens", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="first_step_memory")
    a = ap.parse_args()
    engine = jspec.Engine(
        a.model_path,
        max_total_tokens=a.max_total_tokens,
        max_running_requests=8,
        load=LoadConfig(load_format="dummy"),
    )
    w = engine.worker
    pool = w.state.target_kv
    GiB = 2**30

    def stats() -> dict:
        m = jax.devices()[0].memory_stats() or {}
        return {"in_use_gib": m.get("bytes_in_use", 0) / GiB, "peak_gib": m.get("peak_bytes_in_use", 0) / GiB}

    before = stats()
    scratch = (SamplingParams(), 0)
    w.programs.collecting = []
    w.decode([w.scratch_slot], [[0]], [scratch])
    (job,) = w.programs.collecting
    w.programs.collecting, w.last_decode = None, None
    compiled = job.program.step.lower(*job.args, **job.program.static).compile()
    state_formats = jax.tree.leaves(compiled.input_formats[0][len(w.step_weights())].target_kv)
    formats = [
        {"leaf": name, "array": str(getattr(x, "format", None)), "program": str(f)}
        for name, x, f in zip(("k", "v"), pool, state_formats)
    ]
    alias = [line.strip() for line in compiled.as_text().splitlines() if "input_output_alias" in line][:1]
    steps = []
    for i in range(a.steps):
        old = w.state.target_kv
        jax.block_until_ready(w.decode([w.scratch_slot], [[0]], [scratch]))
        # A leaf the step did not take by donation is still alive: the program copied it.
        donated = {"k_donated": old.k.is_deleted(), "v_donated": old.v.is_deleted()}
        del old
        steps.append({"step": i, **donated, **stats()})
    pool_gib = sum(x.nbytes for x in pool) / GiB
    Results(a.out, a.name, vars(a)).write(
        pool_gib=pool_gib,
        before=before,
        formats=formats,
        alias=alias,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        steps=steps,
    )
    print(f"pool {pool_gib:.2f} GiB; before the first step {before}")
    for f in formats:
        same = "same" if f["array"] == f["program"] else "DIFFERENT"
        print(f"{f['leaf']}: {same}\n  array   {f['array']}\n  program {f['program']}")
    print("alias:", alias[0][:400] if alias else "none found")
    for s in steps:
        print(s)


if __name__ == "__main__":
    main()

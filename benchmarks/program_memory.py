"""Each compiled program's device memory beside its arguments, against the KV pool's size: a
program whose temporaries are pool-sized keeps a second copy of a pool buffer (a donation not
honoured, a copy around a scatter). For such a program, the instructions of its optimized HLO
that produce a buffer of a pool array's shape are listed.

    python -m benchmarks.program_memory --model-path benchmarks/shapes/llama-3.1-8b --max-total-tokens 200000
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import time

import jax

import jspec
from benchmarks.common import Results
from jspec.config.load import LoadConfig
from jspec.engine.sizing import device_memory_stats
from jspec.worker.programs import measure_programs, scratch_decode


def memory_in_use() -> str:
    """The device allocator's bytes in use now and its peak so far (a run that took a pool leaf
    more shows in the peak)."""
    stats = device_memory_stats()
    return (
        f"{stats.get('bytes_in_use', 0) / 2**30:.2f} GiB in use, "
        f"peak so far {stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB"
    )


def pool_shape_lines(hlo: str, shapes: list[str], limit: int = 12) -> list[str]:
    """Instructions of an optimized HLO module whose result has one of these shapes."""
    out = []
    for line in hlo.splitlines():
        line = line.strip()
        if any(re.match(rf"^(ROOT )?%?[\w.\-]+ = {re.escape(s)}", line) for s in shapes):
            out.append(line[:240])
            if len(out) >= limit:
                break
    return out


def time_pools(model, pools: list[int], repeats: int = 10) -> None:
    """Decode B=1 and the largest prefill over pools of these sizes (scratch rows), median ms."""
    from jspec.config.sampling import SamplingParams
    from jspec.worker.inputs import SeqChunk

    for tokens in pools:
        engine = jspec.Engine(model, max_total_tokens=tokens, max_running_requests=8)
        w = engine.worker
        T = w.buckets.prefill_token_buckets()[-1]
        greedy = (SamplingParams(), 0)
        chunk = SeqChunk([0] * T, 0, [0] * (-(-T // w.page_size)))
        runs = {
            "decode B=1": functools.partial(w.decode, [w.scratch_slot], [[0]], [greedy]),
            f"prefill T={T}": functools.partial(w.prefill, [chunk], [0], [None], [greedy]),
        }
        for name, fn in runs.items():
            jax.block_until_ready(fn())
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                times.append(time.perf_counter() - t0)
            times.sort()
            pool_gib = sum(x.nbytes for x in w.state.target_kv) / 2**30
            print(f"pool {pool_gib:7.2f} GiB  {name:<16} {1e3 * times[len(times) // 2]:8.3f} ms", flush=True)
        # The same greedy tokens on the pool's first pages and on its last ones (an index that
        # overflows past some pool size shows here).
        prompt, params = list(range(1, 40)), SamplingParams(max_new_tokens=8, return_logprob=True, top_logprobs_num=5)
        low = engine.generate([prompt], params)[0]
        alloc = engine.scheduler.kv.allocator
        hold = alloc.alloc(alloc.num_free - 8)
        high = engine.generate([prompt], params)[0]
        alloc.free(hold)
        diff = max(abs(a[1] - b[1]) for x, y in zip(low.top_logprobs, high.top_logprobs) for a, b in zip(x, y))
        same = low.token_ids == high.token_ids
        print(f"pool {pool_gib:7.2f} GiB  first vs last pages: same tokens {same}, top-5 logprob diff {diff:.2e}")
        del engine, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="benchmarks/shapes/llama-3.1-8b")
    ap.add_argument("--max-total-tokens", type=int, default=200_000)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument(
        "--speculative-args",
        default="",
        help="e.g. 'EAGLE3 /path/head 3 1 4', with ' adaptive' last for adaptive speculation",
    )
    ap.add_argument(
        "--time-pools",
        help="comma list of pool sizes in tokens: time the largest prefill and decode B=1 over each (a step "
        "that grows with the pool copies it)",
    )
    ap.add_argument(
        "--largest-only",
        action="store_true",
        help="compile the largest prefill and decode programs only (what sizing measures), over the real pool",
    )
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="program_memory")
    ap.add_argument(
        "--mem-fraction",
        default="0.90",
        help="XLA_PYTHON_CLIENT_MEM_FRACTION unless set: the server's, so that a run has the room a server has",
    )
    a = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", a.mem_fraction)
    logging.basicConfig(level="INFO", format="[%(name)s] %(message)s")
    if a.time_pools:
        return time_pools(jspec.load(a.model_path, load_format="dummy"), [int(t) for t in a.time_pools.split(",")])
    spec = None
    if a.speculative_args:
        algo, path, steps, topk, tokens, *adaptive = a.speculative_args.split()
        spec = jspec.SpecConfig(
            algo,
            path,
            num_steps=int(steps),
            eagle_topk=int(topk),
            num_draft_tokens=int(tokens),
            adaptive=adaptive == ["adaptive"],
        )
    t0 = time.perf_counter()
    # From the path, as the server builds it: a Model held here would keep the loader's stacked
    # layers on the device beside the engine's per-layer copies.
    engine = jspec.Engine(
        a.model_path,
        load=LoadConfig(load_format="dummy"),
        max_total_tokens=a.max_total_tokens,
        max_running_requests=a.max_running_requests,
        speculative=spec,
    )
    n = len(measure_programs(engine.worker)) if a.largest_only else engine.warmup()
    if a.largest_only:  # and run one: a donation refused at run time shows only there
        w = engine.worker
        print(f"before the runs: {memory_in_use()}")
        B = w.buckets.decode_buckets()[-1]
        for shape in range(w.num_shapes):  # every draft shape's, with adaptive speculation
            try:
                jax.block_until_ready(scratch_decode(w, B, shape=shape))
                print(f"run: ok (shape {shape}), {memory_in_use()}")
            except Exception as e:  # noqa: BLE001 - reported, the table follows
                print(f"run: FAILED (shape {shape}) {str(e)[:200]}")
    compile_s = time.perf_counter() - t0
    pool = engine.worker.state.target_kv
    dtype = str(pool.k.dtype).replace("bfloat16", "bf16").replace("float32", "f32")
    shapes = [f"{dtype}[{','.join(map(str, x.shape))}]" for x in (pool.k, pool.v)]
    pool_bytes = sum(x.nbytes for x in pool)
    rows = []
    programs = engine.worker.programs
    for key, fn in list(programs.compiled.items()):
        m = programs.memory(key)
        row = dict(
            program=programs.labels[key],
            temp_gib=m.temp_bytes / 2**30,
            new_output_gib=m.new_output_bytes / 2**30,
            argument_gib=m.argument_bytes / 2**30,
            aliased_gib=m.aliased_bytes / 2**30,
        )
        if m.temp_bytes > pool_bytes / 8:
            row["pool_shaped_instructions"] = pool_shape_lines(fn.as_text(), shapes)
        rows.append(row)
    Results(a.out, a.name, vars(a)).write(
        pool_gib=pool_bytes / 2**30, pool_shapes=shapes, programs=rows, compile_s=compile_s, num_programs=n
    )
    print(f"\npool {pool_bytes / 2**30:.2f} GiB {shapes}; {n} programs compiled in {compile_s:.1f} s")
    print(f"{'program':<36} {'temp GiB':>9} {'new out':>8} {'args':>8} {'aliased':>8}")
    for r in sorted(rows, key=lambda r: -r["temp_gib"]):
        print(
            f"{r['program']:<36} {r['temp_gib']:>9.3f} {r['new_output_gib']:>8.3f} {r['argument_gib']:>8.2f} "
            f"{r['aliased_gib']:>8.2f}"
        )
        for line in r.get("pool_shaped_instructions", []):
            print("    ", line)
    print(f"device: {jax.devices()[0].device_kind}")


if __name__ == "__main__":
    main()

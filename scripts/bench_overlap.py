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

    python scripts/bench_overlap.py [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
import numpy as np

from bench_decode import LLAMA_8B, git_commit, random_params, timed
from bench_spec import EAGLE3_8B
import jspec
from jspec.engine.engine import LoopTimes
from jspec.checkpoint.eagle import init_random_draft_params

# SmolLM2-135M's shape: where host overhead matters most.
SMALL = dataclasses.replace(
    LLAMA_8B, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
)
SMALL_DRAFT = dataclasses.replace(
    EAGLE3_8B, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
    vocab_size=49152, draft_vocab_size=16384, capture_layers=(2, 15, 27), max_position_embeddings=2048,
)

# A few-layer model of the same family: CPU dry runs of the benchmark scripts (--tiny).
TINY = dataclasses.replace(SMALL, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=16)
TINY_DRAFT = dataclasses.replace(SMALL_DRAFT, vocab_size=512, draft_vocab_size=256, hidden_size=64,
                                 intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                                 capture_layers=(1, 2, 3))


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
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script itself")
    ap.add_argument("--models", default="small,8b", help="which of small,8b")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], help="e.g. 1,16,64")
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
        cases, prompt_len, new_tokens = [("tiny", TINY, TINY_DRAFT, [1, 4])], 16, 8
    rows = []

    def save():
        """Writes the JSON after every row, so a run cut short still leaves its figures."""
        result = dict(name="bench_overlap", gpu=dev.device_kind, jax_version=jax.__version__, commit=git_commit(),
                      settings=dict(prompt_len=prompt_len, new_tokens=new_tokens, page_size=16,
                                    speculative="EAGLE3 (3,1,4)"), rows=rows)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, args.name + ".json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        return path

    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    for name, cfg, dcfg, batches in cases:
        params = random_params(cfg, dtype)
        dparams = init_random_draft_params(dcfg, jax.random.key(3), dtype)
        for method in ("none", "eagle3"):
            spec = None if method == "none" else jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1)
            for B in batches:
                kv_bytes = 2 * cfg.num_layers * cfg.kv_size * 2 * (B * (prompt_len + new_tokens + 64) + 1024)
                row = dict(model=name, method=method, batch=B)
                for overlap in (True, False):
                    engine = jspec.Engine((cfg, params), speculative=spec, draft=(dcfg, dparams) if spec else None,
                                          page_size=16, max_running_requests=max(B, 1), kv_memory_bytes=kv_bytes,
                                          disable_overlap_schedule=not overlap, disable_radix_cache=True)
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
                    # the overlap loop hides behind the device step (issue 8, target 5).
                    row[f"{key}_host_ms"] = engine.loop_times.per_iteration_ms()
                # Device busy per decode step: the same compiled step on prebuilt inputs, back to back
                # (no host work between launches), at the workload's mid-generation context.
                w = engine.worker
                slots = [w.alloc_slot() for _ in range(B)]
                pages = [w.allocator.alloc(-(-(prompt_len + new_tokens + 64) // 16)) for _ in range(B)]
                greedy = [(jspec.SamplingParams(), 0)] * B
                inputs = jax.device_put(w._decode_inputs(slots, pages, greedy))
                n0 = prompt_len + new_tokens // 2

                def reset_lengths():
                    c = w.state.carry
                    w.state = w.state._replace(carry=c._replace(seq_len=c.seq_len.at[jnp.asarray(slots)].set(n0)))

                decode = lambda: w.decode_arrays(*inputs, "greedy").ints  # noqa: E731
                reset_lengths()
                jax.block_until_ready(decode())
                times = []
                for _ in range(3):
                    reset_lengths()
                    times.append(timed(decode, 10, 1))
                busy = float(np.median(times))
                for s in slots:
                    w.free_slot(s)
                for p in pages:
                    w.allocator.free(p)
                emitted_per_step = 1.0  # random heads accept ~nothing: one token per decode step
                row["device_step_ms"] = busy * 1e3
                decode_steps = new_tokens / emitted_per_step
                for key_ in ("overlap", "sync"):
                    wall_total = B * new_tokens / row[f"{key_}_tok_per_s"]
                    row[f"{key_}_gpu_idle"] = max(0.0, 1 - decode_steps * busy / wall_total)
                row["overlap_speedup"] = row["overlap_tok_per_s"] / row["sync_tok_per_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
    path = save()
    print(f"\nwrote {path}\n")
    print(f"{'model':>6} {'method':>7} {'B':>3} {'overlap tok/s':>13} {'sync tok/s':>10} {'x':>5} "
          f"{'idle ovl':>8} {'idle sync':>9} {'dev ms':>7} {'host ms':>7} {'sched':>6} {'launch':>6} {'proc':>6}")
    for r in rows:
        h = r["overlap_host_ms"]
        print(f"{r['model']:>6} {r['method']:>7} {r['batch']:>3} {r['overlap_tok_per_s']:>13.0f} "
              f"{r['sync_tok_per_s']:>10.0f} {r['overlap_speedup']:>5.2f} {r['overlap_gpu_idle']:>8.1%} "
              f"{r['sync_gpu_idle']:>9.1%} {r['device_step_ms']:>7.3f} {h['host']:>7.3f} {h['schedule']:>6.3f} "
              f"{h['launch']:>6.3f} {h['process']:>6.3f}")


LLAMA_8B_CTX = dataclasses.replace(LLAMA_8B, max_position_embeddings=2048)
EAGLE3_8B_CTX = dataclasses.replace(EAGLE3_8B, max_position_embeddings=2048)

if __name__ == "__main__":
    main()

"""DFLASH's iteration cost on the 8B shape: one plain decode step against one DFLASH iteration
(the block forward, the chain verify, the context injection of the accepted tokens) per batch
bucket, blocks of 8 and 16, random weights.

The target is benchmarks/shapes/llama-3.1-8b at the engine benchmarks' 2048-token context
(--small: the SmolLM2-135M shape, whose steps are mostly launch, into bench_dflash_small.json);
the drafter has --draft-layers Qwen3-style layers of the target's shapes (z-lab's published 8B
drafters have 5), reading the reference's default target layers. Each figure is the least of
--repeats dispatches on scratch rows (the worker's cost-table measurement, a one-token
context), so it is the device time of one step at that batch size, whatever the acceptance:
with a mean accept length A, DFLASH pays when A > its cost / the plain step's.

    python -m benchmarks.bench_dflash [--draft-layers 5] [--small] [--dry-run] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from benchmarks.common import LLAMA_8B_CTX, RESULTS_DIR, SMALL, Results, random_params, spec_costs, tiny
from benchmarks.device_profile import print_summary, profile_calls
from jspec.checkpoint.dflash import dflash_config_for, init_random_dflash_params
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.engine.engine import Engine
from jspec.layers.matmul import SKINNY_MATMUL_ENV, skinny_backend

BLOCKS = (16, 8)


def plain_costs(engine: Engine, repeats: int) -> dict[int, float]:
    w, greedy, out = engine.worker, (SamplingParams(), 0), {}
    for B in w.buckets.decode_buckets():
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(w.decode([w.scratch_slot] * B, [[0]] * B, [greedy] * B))
            times.append(time.perf_counter() - t0)
        out[B] = min(times[1:])  # the first may compile
    return out


def profile_b1(worker, **shape) -> dict:
    """The device kernels of one B=1 step on the scratch row (device_profile.profile_calls)."""
    greedy = (SamplingParams(), 0)
    return profile_calls(lambda: worker.decode([worker.scratch_slot], [[0]], [greedy], **shape))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="max_running_requests: the largest bucket")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="the SmolLM2-135M shape instead of the 8B")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also trace the plain step and each DFLASH shape at B=1 (kernels, busy, gaps)",
    )
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (the CPU check of the script)")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tag", default="", help="suffix of the results file (a variant of the same run)")
    args = ap.parse_args(argv)
    target = dataclasses.replace(SMALL, max_position_embeddings=2048) if args.small else LLAMA_8B_CTX
    cfg = tiny(target) if args.dry_run else target
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    params = random_params(cfg, dtype)
    dcfg = dflash_config_for(cfg, num_layers=args.draft_layers, block_size=max(BLOCKS))
    dparams = init_random_dflash_params(dcfg, jax.random.key(1), dtype)
    kw = dict(
        page_size=16,
        max_total_tokens=64 * 1024 if not args.dry_run else 2048,
        max_running_requests=args.batch if not args.dry_run else 4,
    )
    shape_name = "smollm2-135m" if args.small else "llama-3.1-8b"
    settings = {
        "shape": shape_name,
        "draft_layers": args.draft_layers,
        "dry_run": args.dry_run,
        SKINNY_MATMUL_ENV: skinny_backend(),
    }
    name = "bench_dflash_small" if args.small else "bench_dflash"
    results = Results(
        args.out,
        name,
        {**settings, "target_layer_ids": list(dcfg.target_layer_ids)},
        file_name=f"{name}_{args.tag}" if args.tag else None,
    )
    plain_engine = Engine((cfg, params), **kw)
    plain = plain_costs(plain_engine, args.repeats)
    profiles = {"plain": profile_b1(plain_engine.worker)} if args.profile else {}
    del plain_engine
    results.write(plain_s=plain)
    # One state, a shape per block: the full block, the shorter one, and off (the root alone).
    others = " ".join(f"{b - 1},1,{b}" for b in BLOCKS[1:]) + " 0,1,1"
    spec = SpecConfig("DFLASH", num_draft_tokens=max(BLOCKS), adaptive=True, adaptive_shapes=others)
    engine = Engine((cfg, params), speculative=spec, draft=(dcfg, dparams), **kw)
    costs = spec_costs(engine, args.repeats)
    dflash = {" ".join(map(str, s)): row for s, row in costs.seconds.items()}
    if args.profile:
        for i, m in enumerate(engine.worker.methods):
            profiles["DFLASH " + " ".join(map(str, m.spec.shape))] = profile_b1(engine.worker, shape=i)
        for name, p in profiles.items():
            print_summary(f"profile B=1 {name}", p)
    path = results.write(plain_s=plain, dflash_s=dflash, **({"profile_b1": profiles} if profiles else {}))
    for B in plain:
        shapes = ", ".join(f"DFLASH {s} {r[B] * 1e3:.2f} ms ({r[B] / plain[B]:.2f}x)" for s, r in dflash.items())
        print(f"B={B}: plain {plain[B] * 1e3:.2f} ms; {shapes}")
    print(path)


if __name__ == "__main__":
    main()

"""NEXTN's iteration cost on a DeepSeek (MLA + MoE) shape: one plain decode step against one
NEXTN iteration (draft the tree, verify it, draft-extend) per batch bucket, random weights.

The target is benchmarks/shapes/deepseek-v2-lite cut to --layers layers (a MoE layer after the
first dense one), the MTP layer random weights of the target's own layer shape. Each figure is
the median time of a dispatch on scratch rows (the worker's cost-table measurement), so it is
the device time of one step at that batch size, whatever the acceptance.

    python -m benchmarks.bench_nextn [--layers 4] [--dry-run] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from benchmarks.common import RESULTS_DIR, Results, shape, spec_costs
from jspec.checkpoint.deepseek import mtp_param_shapes
from jspec.checkpoint.loader import init_random_params
from jspec.checkpoint.random_weights import random_weights
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.engine.engine import Engine

SHAPES = "3,1,4 3,2,6 1,1,2"


def config(layers: int, dry: bool):
    cfg = shape("deepseek-v2-lite")
    cfg = dataclasses.replace(cfg, num_layers=layers, moe_layers=tuple(range(1, layers)), max_position_embeddings=4096)
    if dry:
        ds = dataclasses.replace(cfg.deepseek, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
        cfg = dataclasses.replace(
            cfg,
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            num_heads=4,
            head_dim=ds.qk_head_dim,
            deepseek=ds,
        )
    return cfg


def plain_costs(engine: Engine, repeats: int) -> dict[int, float]:
    w, greedy, out = engine.worker, (SamplingParams(), 0), {}
    for B in w.buckets.decode_buckets():
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(w.decode([w.scratch_slot] * B, [[0]] * B, [greedy] * B))
            times.append(time.perf_counter() - t0)
        out[B] = sorted(times[1:])[len(times[1:]) // 2]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="max_running_requests: the largest bucket")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (the CPU check of the script)")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    cfg = config(args.layers, args.dry_run)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    params = init_random_params(cfg, jax.random.key(0), dtype)
    mtp = random_weights(mtp_param_shapes(cfg), jax.random.key(1), dtype)
    kw = dict(page_size=16, max_total_tokens=64 * 1024 if not args.dry_run else 2048, max_running_requests=args.batch)
    results = Results(
        args.out, "bench_nextn", {"layers": args.layers, "shape": "deepseek-v2-lite", "dry_run": args.dry_run}
    )
    plain = plain_costs(Engine((cfg, params), **kw), args.repeats)
    results.write(plain_s=plain)
    spec = SpecConfig("NEXTN", num_steps=3, adaptive=True, adaptive_shapes=SHAPES.split(" ", 1)[1])
    engine = Engine((cfg, params), speculative=spec, draft=(cfg, mtp), **kw)
    costs = spec_costs(engine, args.repeats)
    nextn = {" ".join(map(str, s)): row for s, row in costs.seconds.items()}
    path = results.write(plain_s=plain, nextn_s=nextn)
    for B in plain:
        print(
            f"B={B}: plain {plain[B] * 1e3:.2f} ms; "
            + ", ".join(f"NEXTN {s} {r[B] * 1e3:.2f} ms" for s, r in nextn.items())
        )
    print(path)


if __name__ == "__main__":
    main()

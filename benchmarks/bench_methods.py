"""Every speculative method through the same engine, on the same prompts, in one run.

Output tokens/s and mean accept length (tokens emitted per iteration) for no speculation,
EAGLE-3 (3,1,4), the 1-step path EAGLE-3 (1,1,2), STANDALONE (3 steps, a 2-layer draft
of the target's width) and NGRAM (8 draft tokens), on a SmolLM2-135M-shaped target with
random weights, overlap on. Two prompt sets: repetitive text (a phrase repeated, where
NGRAM shines) and random tokens. Random weights make EAGLE/STANDALONE acceptance ~1 token;
the figures that transfer to real weights are the per-iteration costs.

    python -m benchmarks.bench_methods [--batch 16] [--out benchmarks/results]
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
    RESULTS_DIR,
    SMALL,
    SMALL_DRAFT,
    TINY,
    TINY_DRAFT,
    Results,
    random_params,
)
from jspec.checkpoint.eagle import init_random_draft_params


def workload(engine, prompts, new_tokens):
    params = jspec.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    accept = [o.mean_accept_length for o in outs if o.mean_accept_length]
    return sum(len(o.token_ids) for o in outs) / wall, float(np.mean(accept)) if accept else 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script itself")
    args = ap.parse_args()
    cfg, dcfg_e = SMALL, SMALL_DRAFT
    dtype, B, new = jnp.bfloat16, args.batch, args.new_tokens
    if args.tiny:
        cfg, dcfg_e, dtype, B, new = TINY, TINY_DRAFT, jnp.float32, 2, 12
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    params = random_params(cfg, dtype)
    eagle = (dcfg_e, init_random_draft_params(dcfg_e, jax.random.key(3), dtype))
    dcfg_s = dataclasses.replace(cfg, num_layers=2)
    standalone = (dcfg_s, random_params(dcfg_s, dtype, seed=5))
    rng = np.random.default_rng(0)
    phrase = [list(map(int, rng.integers(0, 500, 16))) for _ in range(B)]
    prompt_sets = {
        "repetitive": [p * 8 for p in phrase],
        "random": [list(map(int, rng.integers(0, 500, 128))) for _ in range(B)],
    }
    methods = {
        "none": (None, None),
        "EAGLE3 (3,1,4)": (jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1), eagle),
        "EAGLE3 (1,1,2)": (jspec.SpecConfig("EAGLE3", num_steps=1, eagle_topk=1), eagle),
        "STANDALONE (3,1,4)": (jspec.SpecConfig("STANDALONE", num_steps=3), standalone),
        "NGRAM (8 tokens)": (jspec.SpecConfig("NGRAM", num_draft_tokens=8), None),
    }
    rows = []
    results = Results(
        args.out,
        "bench_methods",
        {
            "model": "SmolLM2-135M shape, random weights",
            "batch": B,
            "new_tokens": new,
            "page_size": 16,
            "overlap": True,
        },
    )

    def save():
        base = {r["prompts"]: r["tok_per_s"] for r in rows if r["method"] == "none"}
        for r in rows:
            r["vs_no_spec"] = r["tok_per_s"] / base[r["prompts"]] if r["prompts"] in base else None
        return results.write(rows=rows)

    for name, (spec, draft) in methods.items():
        engine = jspec.Engine(
            (cfg, params),
            speculative=spec,
            draft=draft,
            page_size=16,
            max_running_requests=B,
            max_total_tokens=2 * (B * (128 + new + 64) + 1024),
            disable_radix_cache=True,
        )
        for which, prompts in prompt_sets.items():
            workload(engine, prompts, new)  # untimed: compiles what this workload needs
            tok_s, acc = workload(engine, prompts, new)
            row = dict(method=name, prompts=which, batch=B, tok_per_s=tok_s, mean_accept_length=acc)
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
        engine.check_idle_no_leaks()
    path = save()
    print(f"\nwrote {path}\n")
    print(f"{'method':>20} {'prompts':>10} {'tok/s':>8} {'accept':>6} {'vs none':>7}")
    for r in rows:
        print(
            f"{r['method']:>20} {r['prompts']:>10} {r['tok_per_s']:>8.0f} {r['mean_accept_length']:>6.2f} "
            f"{r['vs_no_spec'] or 0:>7.2f}"
        )


if __name__ == "__main__":
    main()

"""Multi-LoRA cost on the GPU: decode iteration time with 0, 1 and 4 distinct adapters in a
batch, EAGLE-3 on (the target: 4 adapters cost <= 15% over none).

Rows, per model shape: the engine without a LoRA pool (the programs without LoRA), and an
engine with a pool of --max-loras adapters of rank --rank (all seven projections), whose
batch rows use 0 (every row the base model), 1 or 4 distinct adapters. Each row gives the
device time of the compiled speculative decode step on prebuilt inputs, back to back
(bench_overlap's method), and the overlap loop's wall time per step on a whole workload.
The pool computes every slot's delta for every token (jspec/lora/pool.py), so the step costs
the same whatever mix of adapters a batch holds; what it adds over no pool is the figure.

    python -m benchmarks.bench_lora [--models small,8b] [--batch 32] [--rank 16] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
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
    random_params,
)
from benchmarks.device_profile import print_summary, profile_calls
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.lora.adapter import SUPPORTED_MODULES, module_shapes


def write_random_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A PEFT adapter directory of random weights on every supported projection."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m, (fan_in, fan_out) in module_shapes(cfg).items():
            kind = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            p = f"base_model.model.model.layers.{layer}.{kind}.{m}"
            tensors[p + ".lora_A.weight"] = rng.standard_normal((rank, fan_in), np.float32) / np.sqrt(fan_in)
            tensors[p + ".lora_B.weight"] = rng.standard_normal((fan_out, rank), np.float32) * 0.01
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(SUPPORTED_MODULES),
                "bias": "none",
            },
            f,
        )
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def run_workload(engine, B, prompt_len, new_tokens, seed, use):
    """B requests (row i with adapter use[i]) through the overlap loop: (wall seconds, steps)."""
    rng = np.random.default_rng(seed)
    for i in range(B):
        engine.add_request(
            list(map(int, rng.integers(0, 500, prompt_len))),
            jspec.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, lora_path=use[i]),
        )
    steps = 0
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def kernel_count(hlo_text: str) -> int:
    """Kernels in a compiled program: its fusions and custom calls (cuBLAS, Triton), each
    counted once even inside a loop body; what the LoRA delta adds is in their difference."""
    return len(re.findall(r"= \S+ (?:fusion|custom-call)\(", hlo_text))


def step_kernels(engine, held: HeldDecode) -> int:
    """kernel_count of the speculative decode step the engine launches (its cached compile)."""
    from jspec.speculative.steps import spec_decode_step

    w = engine.worker
    lowered = spec_decode_step.lower(
        w.params,
        w.dparams,
        w.state,
        *held.inputs,
        held.lora,
        cfg=w.cfg,
        method=w.method,
        backend=w.backend,
        top_n=w.top_n,
        sampling="greedy",
    )
    return kernel_count(lowered.compile().as_text())


def device_step_ms(
    engine, B: int, n0: int, pages_per_req: int, lora_ids, count_kernels: bool = False, profile: bool = False
):
    """The compiled decode step on prebuilt inputs, back to back, at context n0:
    (ms, kernels in the program or None, the step's per-kernel device profile or None)."""
    with HeldDecode(engine, B, pages_per_req, n0, lora_ids) as held:
        ms = held.step_ms()
        kernels = step_kernels(engine, held) if count_kernels else None
        summary = None
        if profile:
            held.reset()
            summary = profile_calls(held.decode, calls=5)
    return ms, kernels, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,8b", help="which of small,8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=4, help="pool slots (adapters resident at once)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script itself")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also split the step's device time per kernel (benchmarks/device_profile.py), without "
        "a pool and with one: which kernels the adapters add",
    )
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--name", default="bench_lora", help="JSON file name under --out")
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    prompt_len, new_tokens, B = 128, 64, args.batch
    cases = [
        (n, c, d)
        for n, c, d in (("small", SMALL, SMALL_DRAFT), ("8b", LLAMA_8B_CTX, EAGLE3_8B_CTX))
        if n in args.models.split(",")
    ]
    if args.tiny:
        cases, prompt_len, new_tokens, B = [("tiny", TINY, TINY_DRAFT)], 16, 8, min(B, 4)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)
    rows = []
    results = Results(
        args.out,
        "bench_lora",
        {
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "batch": B,
            "rank": args.rank,
            "max_loras_per_batch": args.max_loras,
            "speculative": "EAGLE3 (3,1,4)",
            "page_size": 16,
        },
        file_name=args.name,
    )

    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg, dcfg in cases:
            params = random_params(cfg, dtype)
            dparams = init_random_draft_params(dcfg, jax.random.key(3), dtype)
            paths = {
                f"ad{i}": write_random_adapter(os.path.join(tmp, f"{name}-{i}"), cfg, args.rank, i)
                for i in range(args.max_loras)
            }
            ctx = prompt_len + new_tokens + 64
            base = None
            for pool in (False, True):
                lora_kw = (
                    {"lora_paths": paths, "max_loras_per_batch": args.max_loras, "max_lora_rank": args.rank}
                    if pool
                    else {}
                )
                engine = jspec.Engine(
                    (cfg, params),
                    speculative=spec,
                    draft=(dcfg, dparams),
                    page_size=16,
                    max_running_requests=B,
                    max_total_tokens=B * ctx + 1024,
                    disable_radix_cache=True,
                    **lora_kw,
                )
                for distinct in (0, 1, min(4, args.max_loras)) if pool else (0,):
                    names = [None] + list(paths)
                    use = [names[1 + i % distinct] if distinct else None for i in range(B)]
                    for seed in (0, 1):  # untimed: compiles what the workload meets
                        run_workload(engine, B, prompt_len, new_tokens, seed, use)
                    wall, steps = run_workload(engine, B, prompt_len, new_tokens, 2, use)
                    engine.check_idle_no_leaks()
                    ids = [engine.lora.slot_of(u) for u in use] if pool else None
                    step, kernels, prof = device_step_ms(
                        engine,
                        B,
                        prompt_len + new_tokens // 2,
                        -(-ctx // 16),
                        ids,
                        count_kernels=distinct == 0,
                        profile=args.profile and distinct == 0,
                    )
                    base = base if pool else step
                    row = dict(
                        model=name,
                        lora_pool=pool,
                        distinct_adapters=distinct,
                        batch=B,
                        device_step_ms=step,
                        loop_step_ms=wall / steps * 1e3,
                        step_kernels=kernels,
                        overhead_vs_no_pool=step / base - 1,
                    )
                    if prof is not None:
                        row["profile"] = prof
                        print_summary(f"profile {name} pool={pool}", prof)
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
                    results.write(rows=rows)
    path = results.write(rows=rows)
    print(f"\nwrote {path}\n")
    print(f"{'model':>6} {'pool':>5} {'adapters':>8} {'dev ms':>8} {'loop ms':>8} {'overhead':>8} {'kernels':>8}")
    for r in rows:
        print(
            f"{r['model']:>6} {r['lora_pool']!s:>5} {r['distinct_adapters']:>8} {r['device_step_ms']:>8.3f} "
            f"{r['loop_step_ms']:>8.3f} {r['overhead_vs_no_pool']:>8.1%} {r['step_kernels'] or ''!s:>8}"
        )


if __name__ == "__main__":
    main()

"""What a step that prefills while it decodes costs: the plain prefill program at every token
bucket (decode rows ride in it as one-token rows) against the decode step at every row bucket,
each beside its roofline, and the tokens a mixed step may carry under each bound
(EngineConfig.mixed_chunk_slowdown reads the same costs, timed by the engine at warm-up). With
--profile, where the device time of the largest prefills and of the decode of 64 rows goes.

    python -m benchmarks.bench_mixed_step [--tiny] [--profile] [--out benchmarks/results]

The 8B shape (random weights, bf16 on the GPU); --tiny: a tiny model, the CPU check of the
script. Figures: the least of a few runs per bucket, host launch included (as the engine times
them), and the device profile's busy time per call.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.common import (
    LLAMA_8B_CTX,
    RESULTS_DIR,
    Results,
    copy_bandwidth,
    matmul_flops,
    pyplot,
    random_params,
    run_label,
    save_png,
    tiny,
)
from jspec.engine.engine import Engine
from jspec.worker.programs import scratch_decode, scratch_prefill

SLOWDOWNS = (1.5, 2.0, 3.0)


def plot(path_json: str) -> str | None:
    """The PNG beside the JSON: step time against tokens (prefill) and rows (decode), each with
    its roofline."""
    plt = pyplot("bench_mixed_step")
    if plt is None:
        return None
    with open(path_json) as f:
        data = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, x, label in (("prefill", "tokens", "prefill (tokens)"), ("decode", "rows", "decode (rows)")):
        rows = data[key]
        xs = [r[x] for r in rows]
        (line,) = ax.plot(xs, [r["ms"] for r in rows], "o-", label=label)
        ax.plot(xs, [r["roofline_ms"] for r in rows], ":", color=line.get_color(), label=f"{label} roofline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the step (prefill) / rows (decode)")
    ax.set_ylabel("ms per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{data['settings']['shape']} {run_label(data)}", fontsize=9)
    return save_png(fig, path_json)


def matmul_params(params) -> int:
    """Weights a token multiplies (all but the embedding table, which it only indexes)."""
    return sum(x.size for k, v in params.items() if k != "embed" for x in jax.tree.leaves(v))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model (the CPU check of the script)")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time of the largest steps")
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    cfg = tiny(LLAMA_8B_CTX) if args.tiny else LLAMA_8B_CTX
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    params = random_params(cfg, dtype)
    weight_bytes = sum(x.nbytes for k, v in params.items() if k != "embed" for x in jax.tree.leaves(v))
    flops_per_token = 2 * matmul_params(params)
    engine = Engine(
        (cfg, params),
        page_size=16,
        max_total_tokens=100_000 if not args.tiny else 4096,
        max_running_requests=args.max_running_requests if not args.tiny else 8,
        mixed_chunk_slowdown=2.0,
    )
    del params
    engine.warmup(sampling_modes=("greedy",))
    costs = engine.scheduler.step_costs
    bandwidth = copy_bandwidth(1 << 28) if args.tiny else copy_bandwidth()
    peak = matmul_flops(1024) if args.tiny else matmul_flops()

    def roofline_ms(tokens: int) -> float:
        return max(weight_bytes / bandwidth, tokens * flops_per_token / peak) * 1e3

    prefill = [
        {"tokens": T, "ms": s * 1e3, "roofline_ms": roofline_ms(T), "x_roofline": s * 1e3 / roofline_ms(T)}
        for T, s in sorted(costs.prefill.items())
    ]
    decode = [
        {"rows": B, "ms": s * 1e3, "roofline_ms": roofline_ms(B), "x_roofline": s * 1e3 / roofline_ms(B)}
        for B, s in sorted(costs.decode.items())
    ]
    bound = [
        {"decode_rows": B, **{f"tokens_at_{k:g}x": costs.mixed_step_tokens(B, k) for k in SLOWDOWNS}}
        for B in sorted(costs.decode)
    ]
    settings = {
        "shape": "tiny" if args.tiny else "llama-3.1-8b",
        "max_running_requests": args.max_running_requests,
        "copy_bandwidth_tbps": bandwidth / 1e12,
        "matmul_tflops": peak / 1e12,
    }
    results = Results(args.out, "bench_mixed_step", settings)
    figures = dict(prefill=prefill, decode=decode, bound=bound)
    path = results.write(**figures)
    if args.profile:
        from benchmarks.device_profile import print_summary, profile_calls

        w = engine.worker
        largest = sorted(costs.prefill)[-2:]
        profiles = {f"prefill T={T}": profile_calls(lambda T=T: scratch_prefill(w, T), calls=3) for T in largest}
        profiles["decode B=64"] = profile_calls(lambda: scratch_decode(w, min(64, max(costs.decode))), calls=3)
        w.last_decode = None
        for title, s in profiles.items():
            print_summary(title, s)
        path = results.write(**figures, profiles=profiles)
    print(f"{'tokens':>6} {'ms':>7} {'roofline':>8} {'x':>5}    {'rows':>4} {'ms':>7} {'roofline':>8} {'x':>5}")
    for i in range(max(len(prefill), len(decode))):
        p = (
            f"{prefill[i]['tokens']:>6} {prefill[i]['ms']:7.2f} {prefill[i]['roofline_ms']:8.2f} {prefill[i]['x_roofline']:5.2f}"
            if i < len(prefill)
            else " " * 29
        )
        d = (
            f"{decode[i]['rows']:>4} {decode[i]['ms']:7.2f} {decode[i]['roofline_ms']:8.2f} {decode[i]['x_roofline']:5.2f}"
            if i < len(decode)
            else ""
        )
        print(f"{p}    {d}")
    print("tokens a step carrying B decode rows may pad to, by bound:")
    for b in bound:
        print(f"  B={b['decode_rows']:>3}: " + ", ".join(f"{k:g}x {b[f'tokens_at_{k:g}x']}" for k in SLOWDOWNS))
    print(path, plot(path))


if __name__ == "__main__":
    main()

"""Paged attention on Mosaic GPU against the Triton-backend kernels and their rooflines.

Llama-3.1-8B's attention (32 query heads over 8 KV heads, head_dim 128), bf16, page 16: decode at
B = 1 and B = 32, ctx 4096 (B = 32 again over an FP8 pool: e4m3 bytes, half the reads), and tree verify of B = 32 x 8 tokens at ctx 4096, each against the
copy-bandwidth roofline (the KV bytes a call must read over the copy bandwidth measured in this
run); a causal prefill of 2,048 tokens in TFLOP/s (the FLOPs its mask leaves, as bench_kernels
counts them), against the bf16 matmul rate measured in this run. Each variant of either kernel
is checked against the jnp reference and timed on the same Problem with bench_kernels' loop (each
call's output the next query, page-table sets cycling past L2), so both kernels read the same
pages in the same order in one process.

    python -m benchmarks.bench_kernels_mgpu [--quick] [--out benchmarks/results]
    python -m benchmarks.bench_kernels_mgpu --smoke   # tiny shapes, interpreted: checks this script on a CPU
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import bench_kernels
from benchmarks.bench_kernels import (
    LAYER,
    Problem,
    extend_flops,
    random_tree_mask,
    run_plans,
    run_variant,
)
from benchmarks.common import RESULTS_DIR, Results, copy_bandwidth, matmul_flops
from jspec.kernels.paged_decode import decode_plan, paged_decode
from jspec.kernels.paged_decode_mgpu import mosaic_decode_plan, paged_decode_mgpu
from jspec.kernels.paged_extend import extend_plan, paged_extend
from jspec.kernels.paged_extend_mgpu import mosaic_extend_plan, paged_extend_mgpu
from jspec.kernels.paged_tiles import FP8_KV, FP8_KV_BYTES
from jspec.kernels.ref import paged_decode_ref, paged_extend_ref

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


# Beyond each kernel at its defaults, the Mosaic tunings worth timing per case kind: decode's
# deeper pipelines and longer tiles; tree verify's split count (each query block reads the whole
# context); causal prefill's longer KV tiles (more work per softmax step).
MOSAIC_TUNINGS = {
    "decode": {"stages3": dict(num_stages=3), "stages4": dict(num_stages=4), "n128": dict(block_n=128)},
    "fp8": {"stages3": dict(num_stages=3), "n128": dict(block_n=128)},
    "tree": {
        "stages3": dict(num_stages=3),
        "n128": dict(block_n=128),
        "splits1": dict(num_splits=1),
        "splits8": dict(num_splits=8),
    },
    "prefill": {
        "n128": dict(block_n=128),
        "n128_stages3": dict(block_n=128, num_stages=3),
        "stages3": dict(num_stages=3),
    },
}


def variants(kind: str, quick: bool):
    """(kernel, name, tuning): the Triton-backend and Mosaic kernels at their defaults and, unless
    quick, the Mosaic one at kind's tunings."""
    out = [("triton", "triton", {}), ("mosaic", "mosaic", {})]
    if not quick:
        out += [("mosaic", f"mosaic_{name}", tuning) for name, tuning in MOSAIC_TUNINGS[kind].items()]
    return out


def decode_case(name, batch, ctx, page_size, kernel_variants, *, iters, reps, fp8=False):
    """fp8: the pool as the engine stores an FP8 one (e4m3 bytes), half the bytes to read."""
    p = Problem(
        batch=batch,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        q_rows=batch,
    )
    layer = jnp.int32(LAYER)
    k, v = p.k, p.v
    if fp8:
        k, v = (lax.bitcast_convert_type(x.astype(FP8_KV), FP8_KV_BYTES) for x in (k, v))
    ref = paged_decode_ref(p.q, k, v, layer, p.seq_lens, p.page_tables[0], sm_scale=p.sm_scale)
    case = dict(
        name=name,
        kind="decode",
        kv_dtype="fp8_e4m3" if fp8 else "bfloat16",
        batch=batch,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        kv_bytes=p.kv_bytes // 2 if fp8 else p.kv_bytes,
        cache_bytes=2 * k.nbytes,
        page_table_sets=p.sets,
        results=[],
    )
    max_pages = ctx // page_size
    for kernel, vname, tuning in kernel_variants:
        fn, plan_of = {
            "triton": (paged_decode, decode_plan),
            "mosaic": (
                paged_decode_mgpu,
                lambda *a, **kw: mosaic_decode_plan(*a, sm_scale=p.sm_scale, cache_dtype=k.dtype, **kw),
            ),
        }[kernel]
        call = lambda q, pt, k, v, fn=fn, tuning=tuning: fn(
            q, k, v, layer, p.seq_lens, pt, sm_scale=p.sm_scale, **tuning
        )
        try:
            plan = plan_of(batch, NUM_Q_HEADS, p.k.shape, max_pages, **tuning)._asdict()
        except Exception as e:  # noqa: BLE001 - recorded with the variant
            plan = {"error": f"{type(e).__name__}: {e}"}
        extra = {"tuning": tuning, "plan": plan, "kernel": kernel}
        case["results"].append(run_variant(vname, call, ref, p, iters, reps, extra, caches=(k, v)))
        print(f"  {name} {vname}: {case['results'][-1].get('median_us', 'FAILED')}", flush=True)
    return case


def extend_case(name, batch, q_len, ctx, page_size, kernel_variants, *, tree, iters, reps):
    p = Problem(
        batch=batch,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        q_rows=batch * q_len,
    )
    layer = jnp.int32(LAYER)
    query_start = jnp.arange(batch + 1, dtype=jnp.int32) * q_len
    mask = random_tree_mask(batch, q_len) if tree else None
    common = dict(sm_scale=p.sm_scale, max_q_len=q_len, mask=mask)
    ref = paged_extend_ref(p.q, p.k, p.v, layer, p.seq_lens, p.page_tables[0], query_start, **common)
    case = dict(
        name=name,
        kind="extend_tree" if tree else "extend_causal",
        batch=batch,
        q_len=q_len,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        kv_bytes=p.kv_bytes,
        flops=extend_flops(batch, q_len, ctx, mask, num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM),
        page_table_sets=p.sets,
        results=[],
    )
    max_pages = ctx // page_size
    for kernel, vname, tuning in kernel_variants:
        fn, plan_of = {
            "triton": (paged_extend, lambda *a, **kw: extend_plan(*a, batch * q_len, **kw)),
            "mosaic": (
                paged_extend_mgpu,
                lambda *a, **kw: mosaic_extend_plan(*a, batch * q_len, sm_scale=p.sm_scale, tree=tree, **kw),
            ),
        }[kernel]
        call = lambda q, pt, k, v, fn=fn, tuning=tuning: fn(
            q, k, v, layer, p.seq_lens, pt, query_start, **common, **tuning
        )
        try:
            plan = plan_of(batch, NUM_Q_HEADS, p.k.shape, max_pages, q_len, **tuning)._asdict()
        except Exception as e:  # noqa: BLE001 - recorded with the variant
            plan = {"error": f"{type(e).__name__}: {e}"}
        extra = {"tuning": tuning, "plan": plan, "kernel": kernel}
        case["results"].append(run_variant(vname, call, ref, p, iters, reps, extra))
        print(f"  {name} {vname}: {case['results'][-1].get('median_us', 'FAILED')}", flush=True)
    return case


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true", help="default tuning only, fewer repeats")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check this script on a CPU")
    args = parser.parse_args()
    iters, reps = (3, 3) if args.quick else (5, 4)
    shrink = 64 if args.smoke else 1
    if args.smoke:
        iters, reps = 1, 1
        bench_kernels.CALLS_PER_ITER = 1  # an interpreted kernel compiles once per unrolled call

    device = jax.devices()[0]
    print(f"device: {device.device_kind}, jax {jax.__version__}", flush=True)
    copy_bw = copy_bandwidth((1 << 31) // shrink**2)
    mm_flops = matmul_flops(8192 // shrink)
    print(
        f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write), bf16 matmul {mm_flops / 1e12:.0f} TFLOP/s", flush=True
    )
    quick = args.quick or args.smoke
    ctx, prefill = max(64, 4096 // shrink), max(64, 2048 // shrink)
    batch = 2 if args.smoke else 32
    plans = [
        lambda: decode_case("decode_b1_ctx4096_s16", 1, ctx, 16, variants("decode", quick), iters=iters, reps=reps),
        lambda: decode_case(
            f"decode_b{batch}_ctx4096_s16", batch, ctx, 16, variants("decode", quick), iters=iters, reps=reps
        ),
        lambda: decode_case(
            f"decode_fp8_b{batch}_ctx4096_s16", batch, ctx, 16, variants("fp8", quick), iters=iters, reps=reps, fp8=True
        ),
        lambda: extend_case(
            f"tree_b{batch}_q8_ctx4096_s16",
            batch,
            8,
            ctx,
            16,
            variants("tree", quick),
            tree=True,
            iters=iters,
            reps=reps,
        ),
        lambda: extend_case(
            "prefill_b1_q2048_ctx2048_s16",
            1,
            prefill,
            prefill,
            16,
            variants("prefill", quick),
            tree=False,
            iters=iters,
            reps=reps,
        ),
    ]
    results = Results(
        args.out,
        "bench_kernels_mgpu",
        {"iters_per_loop": iters, "repeats": reps, "quick": args.quick, "smoke": args.smoke, "dtype": "bfloat16"},
    )
    cases = []

    def save():
        return results.write(copy_bandwidth_tbps=copy_bw / 1e12, matmul_tflops=mm_flops / 1e12, cases=cases)

    run_plans(plans, cases, save, copy_bw, mm_flops)


if __name__ == "__main__":
    main()

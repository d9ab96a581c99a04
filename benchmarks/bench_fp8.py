"""FP8 decode on the GPU: the decode step against its FP8 floor, and tokens/s against bf16.

For each model shape and batch, the plain decode step (per-layer weights, as the GPU runs
them) in these variants: bf16; FP8 weights per output channel through the default (`auto`),
XLA's dot (the upcast inside it); FP8 weights through the Pallas skinny GEMV, the Triton-backend and the Mosaic GPU
one; W8A8 (activations quantized per token, XLA's FP8 GEMM); the GEMV with an FP8 KV cache too;
and both GEMVs over block scales (the per-channel scales repeated over 128-row blocks, 64 where
128 does not divide K: the same weights, through the block-scale path DeepSeek-V3's
checkpoints take).
Each row: the step's time, its floor (the bytes a step must read: every weight but the
embedding table, scales included, plus the KV of every sequence, over the read bandwidth
measured in the same run), decode tokens/s (batch / step) and its ratio to bf16's, and the
optimized HLO's bf16 arrays of a weight's shape (a dequantised copy written to HBM: the FP8
path reads its weights twice then, and the XLA path is not what it should be).

    python -m benchmarks.bench_fp8 [--shapes llama-3.1-8b,smollm2-135m] [--batches 1,16] [--context 1024]
        [--gemv] [--tiny] [--out DIR]

--gemv: instead of the steps, each of the shape's projections alone at one row, FP8 per output
channel (bench_fp8_gemv.json): XLA's dot, the Triton-backend GEMV over FP8_GEMV_SWEEP's tiles
and the Mosaic GPU one over its configs, each checked against the dequantised product, at its
FP8 bytes' bandwidth: which tiles read FP8 at bandwidth, where the step's 0.6x line needs them.

--tiny: a 3-layer model of the small shape on whatever backend (a CPU dry run of the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_decode import MOSAIC_CONFIGS, pallas_configs, projection_shapes
from benchmarks.common import RESULTS_DIR, Results, int_list, random_params, read_bandwidth, shape, timed, tiny
from jspec.kernels.ref import dequantize_fp8
from jspec.kernels.skinny_matmul import skinny_matmul
from jspec.kernels.skinny_matmul_mgpu import mosaic_skinny_unsupported, skinny_matmul_mgpu
from jspec.kvcache.pool import KVPool
from jspec.layers.penalties import init_penalty_state
from jspec.layers.quant import (
    QUANTIZED_LEAVES,
    fp8_dot_xla,
    is_fp8,
    quantize_params,
    quantize_per_channel,
    with_fp8_gemm,
)
from jspec.layers.sampling import sampling_rows
from jspec.models.common import unstack_layers
from jspec.steps.plain import PlainCarry, PlainState, plain_decode_step

VARIANTS = {  # name: (quantization, FP8 matmul path, KV dtype)
    "bf16": (None, None, jnp.bfloat16),
    "fp8_auto": ("fp8", "auto", jnp.bfloat16),
    "fp8_xla": ("fp8", "xla", jnp.bfloat16),
    "fp8_pallas": ("fp8", "pallas", jnp.bfloat16),
    "fp8_mosaic": ("fp8", "mosaic", jnp.bfloat16),
    "fp8_w8a8": ("fp8", "w8a8", jnp.bfloat16),
    "fp8_pallas_fp8kv": ("fp8", "pallas", jnp.float8_e4m3fn),
    "fp8_pallas_block": ("fp8_block", "pallas", jnp.bfloat16),
    "fp8_mosaic_block": ("fp8_block", "mosaic", jnp.bfloat16),
}
PAGE = 16
# The Triton-backend GEMV's tiles over FP8 weights: (block_n, block_k, num_stages, splits x the
# plan's, num_warps), as bench_decode's sweep. A 128 x 128 FP8 tile is 16 KiB, half a bf16 one, so
# the default keeps half the bytes in flight that it does for bf16: the wider tiles restore them.
FP8_GEMV_SWEEP = (
    (128, 128, 3, 1, 4),  # the default plan
    (128, 128, 4, 1, 4),
    (128, 128, 3, 2, 4),
    (256, 128, 3, 1, 4),
    (256, 128, 4, 1, 4),
    (256, 128, 3, 2, 8),
    (128, 256, 3, 1, 4),
    (256, 256, 3, 1, 8),
)


def fp8_gemv_rows(cfg, dtype, bandwidth: float, copies: int = 4) -> list[dict]:
    """Each projection at one row through every FP8 path and tile: time over `copies` distinct
    weights (so L2 holds none), bandwidth of the FP8 bytes and scales, error against the
    dequantised product. A config that does not compile is recorded, not fatal."""
    key = iter(jax.random.split(jax.random.key(30), 64))
    gpu = jax.default_backend() == "gpu"
    rows = []
    for name, (k, n) in projection_shapes(cfg).items():
        ws = [quantize_per_channel(jax.random.normal(next(key), (k, n), jnp.float32) * 0.02) for _ in range(copies)]
        x = jax.random.normal(next(key), (1, k), dtype)
        ref = jnp.dot(x.astype(jnp.float32), dequantize_fp8(ws[0].w, ws[0].scale))
        nbytes = ws[0].w.nbytes + ws[0].scale.nbytes
        paths = [("xla", {}, lambda x, w: fp8_dot_xla(x, w.w, w.scale))]
        configs = pallas_configs(1, k, n, FP8_GEMV_SWEEP)
        paths += [("pallas", c, lambda x, w, c=c: skinny_matmul(x, w.w, w.scale, **c)) for c in configs]
        if gpu:
            paths += [
                ("mosaic", c, lambda x, w, c=c: skinny_matmul_mgpu(x, w.w, w.scale, **c))
                for c in MOSAIC_CONFIGS
                if mosaic_skinny_unsupported(1, k, n, ws[0].w.dtype, block_n=c.get("block_n")) is None
            ]
        for path, conf, fn in paths:
            row = dict(projection=name, shape=[k, n], path=path, config=conf)
            f = jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws])
            try:
                out = f(x, ws)[0]
                t = timed(lambda f=f, ws=ws: f(x, ws), 10, 5) / copies
                scale = float(jnp.max(jnp.abs(ref))) or 1.0
                row |= dict(
                    us=t * 1e6,
                    TBps=nbytes / t / 1e12,
                    x_floor=t / (nbytes / bandwidth),
                    rel_err=float(jnp.max(jnp.abs(out - ref))) / scale,
                )
                row["ok"] = row["rel_err"] < 2e-2  # x rounds to the compute dtype: bf16 on the GPU
            except Exception as e:  # noqa: BLE001 - one config that does not compile must not hide the others
                row |= dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(row), flush=True)
            rows.append(row)
        del ws
    return rows


def print_gemv_best(rows: list[dict]) -> None:
    """Per projection: XLA's dot, the default tiles and the fastest of each kernel."""
    print(
        f"{'projection':>10} {'xla us':>8} {'pallas default':>15} {'pallas best':>12} {'mosaic best':>12}  best pallas tiles"
    )
    for name in dict.fromkeys(r["projection"] for r in rows):
        ok = [r for r in rows if r["projection"] == name and r.get("ok")]
        xla = next((r["us"] for r in ok if r["path"] == "xla"), float("nan"))
        pallas = [r for r in ok if r["path"] == "pallas"]
        first = pallas_configs(1, *pallas[0]["shape"], FP8_GEMV_SWEEP)[0] if pallas else None
        default = next((r["us"] for r in pallas if r["config"] == first), float("nan"))
        best = min(pallas, key=lambda r: r["us"], default=None)
        mosaic = min((r["us"] for r in ok if r["path"] == "mosaic"), default=float("nan"))
        tiles = best["config"] if best else None
        print(
            f"{name:>10} {xla:>8.1f} {default:>15.1f} {best['us'] if best else float('nan'):>12.1f} {mosaic:>12.1f}  {tiles}"
        )


def as_block_scaled(params):
    """Per-channel FP8 weights with each scale row repeated over blocks of 128 input rows (64
    where 128 does not divide them): the same values, multiplied through the block-scale path."""

    def blocks(a):
        rows = 128 if a.shape[-2] % 128 == 0 else 64
        return dataclasses.replace(a, scale=jnp.repeat(a.scale, a.shape[-2] // rows, axis=-2))

    return jax.tree.map(lambda a: blocks(a) if is_fp8(a) else a, params, is_leaf=is_fp8)


def weight_bytes(params) -> int:
    """Bytes a step reads of the weights: all but the embedding table (one row per token)."""
    return sum(x.nbytes for k, v in params.items() if k != "embed" for x in jax.tree.leaves(v))


def dequantised_copies(hlo: str, shapes: set[str]) -> int:
    """Non-trivial ops of the optimized HLO whose result is an array of a projection's shape in
    the model dtype (shapes: "bf16[4096,6144]", ...)."""
    n = 0
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = ((?:bf16|f32)\[[\d,]*\])(?:\{[^}]*\})? ([\w\-]+)\(", line)
        if m and m.group(1) in shapes and m.group(2) not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            n += 1
    return n


def run_variant(cfg, base, variant: str, batches, ctx: int, bandwidth: float, dtype) -> list[dict]:
    quant, gemm, kv_dtype = VARIANTS[variant]
    if jax.default_backend() != "gpu" and kv_dtype == jnp.bfloat16:
        kv_dtype = dtype
    fp8_kv = kv_dtype == jnp.float8_e4m3fn
    params = quantize_params(base, "fp8" if quant == "fp8_block" else quant)
    if quant == "fp8_block":
        params = as_block_scaled(params)
    if gemm:
        params = with_fp8_gemm(params, gemm)
    weights = unstack_layers(params)
    hlo_dtype = {"float32": "f32", "bfloat16": "bf16"}[jnp.dtype(dtype).name]
    proj_shapes = {f"{hlo_dtype}[{','.join(map(str, base['layers'][n].shape[1:]))}]" for n in QUANTIZED_LEAVES}
    per_seq = (ctx + 128) // PAGE
    num_pages = max(batches) * per_seq + 2
    kv_shape = (cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim)
    if fp8_kv:  # the engine's FP8 pool: e4m3 values stored as bytes
        fill = jax.jit(
            lambda k: jax.lax.bitcast_convert_type(
                (jax.random.normal(k, kv_shape, jnp.float32) * 0.5).astype(kv_dtype), jnp.uint8
            )
        )
    else:
        fill = jax.jit(lambda k: (jax.random.normal(k, kv_shape, jnp.float32) * 0.5).astype(kv_dtype))
    kv = KVPool(fill(jax.random.key(10)), fill(jax.random.key(11)))
    rng = np.random.default_rng(0)
    rows = []
    for B in batches:
        pages = rng.permutation(np.arange(1, num_pages))[: B * per_seq].reshape(B, per_seq)
        slot_ids = jnp.arange(B, dtype=jnp.int32)
        page_tables = jnp.asarray(pages, jnp.int32)
        greedy = jax.tree.map(jnp.asarray, sampling_rows([], [], B))
        # From ctx - 64 tokens: the ~80 timed steps end near ctx (the pages hold ctx + 128).
        carry = PlainCarry(
            jnp.asarray(rng.integers(0, cfg.vocab_size, B + 1), jnp.int32),
            jnp.full(B + 1, ctx - 64, jnp.int32).at[B].set(0),
        )
        state = {"s": PlainState(kv, carry, init_penalty_state(B, cfg.vocab_size))}
        args = (weights, state["s"], slot_ids, page_tables, greedy)
        compiled = plain_decode_step.lower(*args, cfg=cfg, sampling="greedy").compile()
        hlo = compiled.as_text()

        def step():
            state["s"], out = compiled(weights, state["s"], slot_ids, page_tables, greedy)
            return out.ints

        jax.block_until_ready(step())
        step_s = timed(step, 20, 3)
        kv_bytes = 2 * cfg.num_layers * B * ctx * cfg.kv_size * jnp.dtype(kv_dtype).itemsize
        floor_s = (weight_bytes(params) + kv_bytes) / bandwidth
        row = dict(
            variant=variant,
            batch=B,
            context=ctx,
            step_ms=step_s * 1e3,
            floor_ms=floor_s * 1e3,
            x_floor=step_s / floor_s,
            tokens_per_s=B / step_s,
            weight_mb=weight_bytes(params) / 2**20,
            kv_mb=kv_bytes / 2**20,
            dequantised_weight_copies=dequantised_copies(hlo, proj_shapes) if quant else None,
        )
        print(json.dumps(row), flush=True)
        rows.append(row)
        kv = state["s"].target_kv
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3.1-8b,smollm2-135m")
    ap.add_argument("--batches", type=int_list, default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--gemv", action="store_true", help="the projections alone at one row, every FP8 path and tile")
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script")
    ap.add_argument("--name", default=None, help="the JSON's name (default bench_fp8, or bench_fp8_gemv)")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    shapes = [(n, shape(n)) for n in args.shapes.split(",")]
    batches, ctx = args.batches, args.context
    if args.tiny:
        shapes, batches, ctx = [("tiny", tiny(shape("smollm2-135m"), num_layers=3))], [1, 4], 64
    bandwidth = read_bandwidth(1 << 31 if gpu else 1 << 22)
    settings = dict(batches=batches, context=ctx, read_bandwidth_gbs=bandwidth / 1e9, tiny=args.tiny)
    if args.gemv:
        settings = dict(shapes=[n for n, _ in shapes], rows=1, read_bandwidth_gbs=bandwidth / 1e9, tiny=args.tiny)
        results = Results(args.out, args.name or "bench_fp8_gemv", settings)
        rows = []
        for name, cfg in shapes:
            rows += [dict(r, shape_name=name) for r in fp8_gemv_rows(cfg, dtype, bandwidth)]
            results.write(rows=rows)
        print_gemv_best(rows)
        return rows
    results = Results(args.out, args.name or "bench_fp8", settings)
    rows = []
    for name, cfg in shapes:
        base = random_params(cfg, dtype)
        for variant in args.variants.split(","):
            for row in run_variant(cfg, base, variant, batches, ctx, bandwidth, dtype):
                row["shape"] = name
                rows.append(row)
                bf16 = next(
                    (r for r in rows if r["variant"] == "bf16" and r["shape"] == name and r["batch"] == row["batch"]),
                    None,
                )
                row["tokens_per_s_vs_bf16"] = row["tokens_per_s"] / bf16["tokens_per_s"] if bf16 else None
            results.write(rows=rows)
        del base
    return rows


if __name__ == "__main__":
    main()

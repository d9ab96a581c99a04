"""Decode-step time on the GPU against the weight + KV bandwidth floor.

A Llama-3.1-8B-shaped model with random bf16 weights (made on the device) runs
one decode token per sequence through the paged KV pool: the jitted
forward+sample step with the pool donated, exactly what generation runs.
Floors: bytes that must be read (all weights but the embedding table, plus the
KV of every sequence) over the copy bandwidth measured in the same run, and
for big batches the matmul FLOPs over the measured bf16 matmul rate.

    python -m benchmarks.bench_decode [--quick] [--parts] [--tag NAME] [--out benchmarks/results]

--parts adds rows that split a bs=1 step's time: each GEMV shape alone, and the step's
matmuls only (every layer's QKV, O, gate-up and down, then the LM head, nothing else), so
the gap to the floor divides into GEMV efficiency and everything else (norms, RoPE,
attention, KV writes, launches). Each GEMV shape is timed four ways: XLA with W [K, N] (the
models' layout), XLA with W stored transposed [N, K], the Pallas skinny_matmul (Triton
backend) over a small sweep of tile configs, and the Mosaic GPU one (skinny_matmul_mgpu) at a
few, each checked against the jnp reference, ending in a per-shape TB/s table. --tag names
the JSON (bench_decode_TAG.json), for runs under different XLA_FLAGS (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    LLAMA_8B,
    RESULTS_DIR,
    SMALL,
    Results,
    copy_bandwidth,
    int_list,
    matmul_flops,
    random_params,
    read_bandwidth,
    timed,
    tiny,
)
from benchmarks.device_profile import print_summary, profile_calls
from jspec.config.model import ModelConfig
from jspec.kvcache.pool import KVPool
from jspec.layers.matmul import lays_out_projections_out_in, with_out_in_projections
from jspec.layers.penalties import init_penalty_state
from jspec.layers.sampling import sampling_rows
from jspec.models.common import unstack_layers
from jspec.steps.plain import PlainCarry, PlainState, plain_decode_step

# The Mosaic GPU skinny matmul's configs (each shape's plan picks its splits): its default, a
# deeper pipeline, and wider strips.
MOSAIC_CONFIGS = [{}, dict(num_stages=6), dict(block_n=256, num_stages=3)]

# Pallas skinny_matmul configs per weight shape: (block_n, block_k, num_stages, splits x the plan's).
# Shared memory is about block_k * block_n * 2 bytes * num_stages (of 227 KiB per SM): 32 KiB tiles x 3
# stages (96 KiB) leave room for two programs per SM, x 4 stages (128 KiB) for one; the 64 KiB-tile
# configs (192 KiB) fit one program per SM and are the first to fail if Triton needs more than that.
PALLAS_SWEEP = (
    (128, 128, 3, 1),  # the plan's default
    (128, 128, 3, 2),
    (128, 128, 4, 1),
    (64, 256, 3, 1),
    (64, 128, 4, 1),
    (256, 128, 3, 1),
    (128, 256, 3, 1),
    (64, 512, 3, 1),
)


def pallas_configs(B: int, k: int, n: int, sweep=PALLAS_SWEEP) -> list[dict]:
    """A sweep of (block_n, block_k, num_stages, splits x the plan's[, num_warps: 4]) resolved for
    one shape: blocks no larger than the (power-of-two padded) dims, splits from
    skinny_matmul_plan, duplicates dropped (a tiny model's shapes collapse several)."""
    from jspec.kernels.paged_tiles import next_pow2
    from jspec.kernels.skinny_matmul import skinny_matmul_plan

    configs = []
    for bn, bk, stages, mult, *warps in sweep:
        bn, bk = min(bn, max(16, next_pow2(n))), min(bk, max(16, next_pow2(k)))
        plan = skinny_matmul_plan(B, k, n, block_n=bn, block_k=bk)
        num_warps = warps[0] if warps else 4
        cfg = dict(block_n=bn, block_k=bk, num_splits=plan.num_splits * mult, num_stages=stages, num_warps=num_warps)
        # The splits the kernel will really run (the plan clamps and drops empty ones).
        cfg["num_splits"] = skinny_matmul_plan(B, k, n, block_n=bn, block_k=bk, num_splits=cfg["num_splits"]).num_splits
        if cfg not in configs:
            configs.append(cfg)
    return configs


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """[in, out] of each decode projection, the LM head included."""
    q = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return {
        "qkv": (cfg.hidden_size, q),
        "o": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
        "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size),
        "down": (cfg.intermediate_size, cfg.hidden_size),
        "lm_head": (cfg.hidden_size, cfg.vocab_size),
    }


def gemv_rows(cfg: ModelConfig, dtype, bw: float, batches=(1,), copies=4) -> list[dict]:
    """Time of x @ W for each decode weight shape, over `copies` distinct W (so L2 holds none),
    and of the whole step's matmul chain. Bandwidth = weight bytes / time.

    Per shape: XLA with W [K, N] (the models' layout, part gemv_NAME), XLA with W stored
    transposed [N, K] (gemv_NAME_nk), and the Pallas skinny_matmul over pallas_configs
    (pallas_NAME, each checked against the jnp reference; a config that fails to compile or
    run is recorded with ok=False and the sweep goes on)."""
    from jspec.kernels.ref import skinny_matmul_ref
    from jspec.kernels.skinny_matmul import MAX_ROWS, skinny_matmul
    from jspec.kernels.skinny_matmul_mgpu import mosaic_skinny_unsupported, skinny_matmul_mgpu

    shapes = projection_shapes(cfg)
    key = iter(jax.random.split(jax.random.key(20), 64))
    rows = []

    def time_row(part, f, x, ws, B, k, n, **extra):
        jax.block_until_ready(f(x, ws))
        t = timed(lambda: f(x, ws), 10, 5) / copies
        row = dict(
            part=part,
            batch=B,
            shape=[k, n],
            us=t * 1e6,
            TBps=k * n * 2 / t / 1e12,
            x_floor=t / (k * n * 2 / bw),
            **extra,
        )
        print(json.dumps(row), flush=True)
        return row

    def checked_rows(part, kernel, configs, x, ws, B, k, n):
        """The kernel at each config, checked against the reference; a config that fails
        to compile or run is recorded with ok=False and the sweep goes on."""
        ref = skinny_matmul_ref(x, ws[0])
        for conf in configs:
            # f32 out, uncast: the check reads the timed program's own output (one compile per
            # config); writing M * N * 4 bytes instead of 2 is noise against K * N * 2 read.
            f = jax.jit(lambda x, ws, conf=conf: [kernel(x, w, **conf) for w in ws])
            try:
                out = f(x, ws)[0]
                err = float(jnp.max(jnp.abs(out - ref)))
                ok = bool(jnp.allclose(out, ref, rtol=2e-3, atol=2e-3))
                rows.append(time_row(part, f, x, ws, B, k, n, config=conf, max_abs_err=err, ok=ok))
            except Exception as e:  # noqa: BLE001 - one config that does not compile must not hide the others
                row = dict(part=part, batch=B, shape=[k, n], config=conf, ok=False)
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)

    for B in batches:
        for name, (k, n) in shapes.items():
            ws = [jax.random.normal(next(key), (k, n), dtype) * 0.02 for _ in range(copies)]
            x = jax.random.normal(next(key), (B, k), dtype)
            f = jax.jit(lambda x, ws: [jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype) for w in ws])
            rows.append(time_row(f"gemv_{name}", f, x, ws, B, k, n))

            if B <= MAX_ROWS:
                checked_rows(f"pallas_{name}", skinny_matmul, pallas_configs(B, k, n), x, ws, B, k, n)
            runnable = [
                c for c in MOSAIC_CONFIGS if not mosaic_skinny_unsupported(B, k, n, dtype, block_n=c.get("block_n"))
            ]
            checked_rows(f"mosaic_{name}", skinny_matmul_mgpu, runnable, x, ws, B, k, n)
            del ws

            # The same product with W stored transposed, [N, K]: contract x's dim 1 with W's dim 1.
            ws = [jax.random.normal(next(key), (n, k), dtype) * 0.02 for _ in range(copies)]
            f = jax.jit(
                lambda x, ws: [
                    jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(
                        dtype
                    )
                    for w in ws
                ]
            )
            rows.append(time_row(f"gemv_{name}_nk", f, x, ws, B, k, n))
            del ws
        rows.append(matmul_chain_row(cfg, dtype, shapes, B, bw, next(key), next(key)))
    return rows


def matmul_chain_row(cfg: ModelConfig, dtype, shapes: dict, B: int, bw: float, head_key, x_key) -> dict:
    """The step's matmuls alone: every layer's (qkv, o, gate_up, down), then the LM head, chained
    through x."""
    layers = [
        {
            nm: jax.random.normal(jax.random.key(100 * i + j), shapes[nm], dtype) * 0.02
            for j, nm in enumerate(("qkv", "o", "gate_up", "down"))
        }
        for i in range(cfg.num_layers)
    ]
    head = jax.random.normal(head_key, shapes["lm_head"], dtype) * 0.02
    H, I = cfg.hidden_size, cfg.intermediate_size

    @jax.jit
    def chain(x, layers, head):
        for lp in layers:
            qkv = jnp.dot(x, lp["qkv"], preferred_element_type=jnp.float32).astype(dtype)
            x = x + jnp.dot(qkv[:, :H], lp["o"], preferred_element_type=jnp.float32).astype(dtype)
            gu = jnp.dot(x, lp["gate_up"], preferred_element_type=jnp.float32)
            x = x + jnp.dot(
                (jax.nn.silu(gu[:, :I]) * gu[:, I:]).astype(dtype), lp["down"], preferred_element_type=jnp.float32
            ).astype(dtype)
        return jnp.argmax(jnp.dot(x, head, preferred_element_type=jnp.float32), axis=-1)

    x = jax.random.normal(x_key, (B, H), dtype)
    jax.block_until_ready(chain(x, layers, head))
    t = timed(lambda: chain(x, layers, head), 10, 5)
    nbytes = sum(w.nbytes for lp in layers for w in lp.values()) + head.nbytes
    row = {"part": "matmul_chain", "batch": B, "us": t * 1e6, "TBps": nbytes / t / 1e12, "x_floor": t / (nbytes / bw)}
    print(json.dumps(row), flush=True)
    return row


def print_gemv_summary(parts: list[dict]) -> None:
    """One line per (batch, shape): XLA [K, N], XLA [N, K], and the best Pallas (Triton backend)
    and Mosaic GPU configs that matched the reference, in TB/s."""
    print(f"{'shape':>8} {'B':>3} {'xla kn':>7} {'xla nk':>7} {'pallas':>7} {'mosaic':>7}  best configs (ok/tried)")
    for r in parts:
        if not r["part"].startswith("gemv_") or r["part"].endswith("_nk"):
            continue
        name, B = r["part"][len("gemv_") :], r["batch"]
        nk = [p["TBps"] for p in parts if p["part"] == f"gemv_{name}_nk" and p["batch"] == B]
        best, notes = {}, []
        for kernel in ("pallas", "mosaic"):
            tried = [p for p in parts if p["part"] == f"{kernel}_{name}" and p["batch"] == B]
            good = [p for p in tried if p.get("ok")]
            best[kernel] = max(good, key=lambda p: p["TBps"]) if good else None
            conf = json.dumps(best[kernel]["config"]) if good else "-"
            notes.append(f"{kernel} {conf} ({len(good)}/{len(tried)})")
        tbps = {k: (b["TBps"] if b else float("nan")) for k, b in best.items()}
        print(
            f"{name:>8} {B:>3} {r['TBps']:>7.2f} {nk[0] if nk else float('nan'):>7.2f} "
            f"{tbps['pallas']:>7.2f} {tbps['mosaic']:>7.2f}  {'; '.join(notes)}"
        )


def forward_ms(weights, cfg: ModelConfig, kv: KVPool, page_tables, ctx: int, q: int, iters: int, repeats: int):
    """The target's forward over q new tokens per sequence at context ctx, every token's
    logits wanted (what verify runs; q = 1 is a decode step's forward): (ms, kv).
    q > 1 takes a tree-shaped mask (a node sees the root and the nodes on its branch, two
    branches), which costs what any mask of that size does."""
    from jspec.layers.attention import AttentionMode
    from jspec.layers.batch import ForwardBatch, bucket
    from jspec.models.forward import forward

    B, S = page_tables.shape[0], kv.page_size
    pos = ctx + np.arange(q)[None] + np.zeros((B, 1), np.int64)
    pt = np.asarray(page_tables)
    slots = pt[np.arange(B)[:, None], pos // S] * S + pos % S
    Q = bucket(q) if q > 1 else 1
    mask = None
    if q > 1:
        tree = np.tril(np.ones((q, q), bool))
        tree[1 + (q - 1) // 2 :, 1 : 1 + (q - 1) // 2] = False  # the second branch does not see the first
        mask = jnp.asarray(np.zeros((B, Q, Q), bool)).at[:, :q, :q].set(jnp.asarray(tree))
    batch = ForwardBatch(
        tokens=jnp.asarray(np.random.default_rng(q).integers(0, cfg.vocab_size, B * q), jnp.int32),
        positions=jnp.asarray(pos.reshape(-1), jnp.int32),
        slots=jnp.asarray(slots.reshape(-1), jnp.int32),
        seq_lens=jnp.full(B, ctx + q, jnp.int32),
        page_tables=jnp.asarray(pt, jnp.int32),
        query_start=jnp.arange(B + 1, dtype=jnp.int32) * q,
        logits_indices=jnp.arange(B * q, dtype=jnp.int32),
    )
    mode = AttentionMode(q == 1, Q, "pallas")
    run = jax.jit(lambda w, kv, batch, mask: forward(w, cfg, kv, batch, mode, mask=mask), donate_argnums=1)
    state = {"kv": kv}

    def step():
        state["kv"], out = run(weights, state["kv"], batch, mask)
        return out.logits

    jax.block_until_ready(step())
    return timed(step, iters, repeats) * 1e3, state["kv"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int_list, help="e.g. 1,32")
    ap.add_argument("--contexts", type=int_list, help="e.g. 1024,4096")
    ap.add_argument("--no-stacked", action="store_true", help="skip the stacked-weights comparison rows")
    ap.add_argument("--quick", action="store_true", help="fewer cases and iterations")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: a CPU dry run of the script itself")
    ap.add_argument(
        "--small", action="store_true", help="the SmolLM2-135M shape instead of the 8B: a step set by its kernel count"
    )
    ap.add_argument("--parts", action="store_true", help="also time each GEMV shape and the matmul-only step")
    ap.add_argument("--tag", help="results file bench_decode_TAG.json (e.g. an XLA_FLAGS variant)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="trace a few decode steps per case and split their device time by kernel "
        "(benchmarks/device_profile.py): busy vs launch gaps, matmuls vs attention vs the rest",
    )
    ap.add_argument(
        "--hlo",
        action="store_true",
        help="also write each per-layer case's optimized HLO (XLA's fusions, as the profile names "
        "them) beside the results: bench_decode[_TAG]_B{B}_ctx{ctx}.hlo.txt",
    )
    ap.add_argument(
        "--verify-tokens",
        type=int,
        default=8,
        help="also time the target forward over this many tokens per sequence against a decode "
        "forward (the verify-cost target; 0: skip)",
    )
    args = ap.parse_args()

    cfg, dtype, S = (SMALL if args.small else LLAMA_8B), jnp.bfloat16, args.page_size
    if args.tiny:
        cfg = tiny(cfg, num_layers=2)
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    elements, n = (1 << 20, 256) if args.tiny else (1 << 31, 8192)
    copy_bw, read_bw, mm_rate = copy_bandwidth(elements), read_bandwidth(elements), matmul_flops(n)
    print(
        f"copy (read+write) {copy_bw / 1e12:.2f} TB/s, read {read_bw / 1e12:.2f} TB/s, "
        f"bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    # The floor uses the best bandwidth measured here (the stricter floor).
    bw = max(copy_bw, read_bw)

    parts = gemv_rows(cfg, dtype, bw) if args.parts else []
    params = random_params(cfg, dtype)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embed"].nbytes
    matmul_params = weight_bytes // 2 - cfg.hidden_size * (2 * cfg.num_layers + 1)

    batches = [1, 8, 32, 128]
    contexts = [1024, 4096]
    if args.quick:
        batches, contexts = [1, 32], [1024]
    if args.tiny:
        batches, contexts = [1, 4], [64]
    batches, contexts = args.batches or batches, args.contexts or contexts
    max_tokens = max(batches) * (max(contexts) + 128)  # 128 tokens of room to decode into
    num_pages = max_tokens // S + 2
    kv_shape = (cfg.num_layers, num_pages, S, cfg.num_kv_heads, cfg.head_dim)
    # Random, not zeros (zeros can time faster than real data); one layer at a time bounds the f32 temporaries.
    fill = jax.jit(
        lambda k: jax.lax.map(lambda kk: jax.random.normal(kk, kv_shape[1:], dtype), jax.random.split(k, kv_shape[0]))
    )
    kv = KVPool(fill(jax.random.key(10)), fill(jax.random.key(11)))
    rng = np.random.default_rng(0)
    rows = []
    settings = {
        "model": f"{'smollm2-135m' if args.small else 'llama-3.1-8b'} shape, random bf16",
        "page_size": S,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "tag": args.tag,
    }
    results = Results(args.out, "bench_decode", settings, file_name=f"bench_decode_{args.tag}" if args.tag else None)

    def save():
        return results.write(
            copy_bandwidth_TBps=copy_bw / 1e12,
            read_bandwidth_TBps=read_bw / 1e12,
            floor_bandwidth_TBps=bw / 1e12,
            matmul_TFLOPs=mm_rate / 1e12,
            weight_bytes=int(weight_bytes),
            rows=rows,
            parts=parts,
        )

    # Per-layer weight arrays (what the engine runs) everywhere; the stacked layout under
    # lax.scan at a few points, to show what slicing a stacked weight costs.
    per_layer = unstack_layers(params)
    if lays_out_projections_out_in():  # as the engine's build lays the weights out
        per_layer = with_out_in_projections(per_layer, per_layer_ndim=2)
        params = with_out_in_projections(params, per_layer_ndim=3)
    cases = [("per_layer", ctx, B) for ctx in contexts for B in batches]
    if not args.no_stacked:
        cases += [("stacked_scan", c, b) for c, b in ((1024, 1), (4096, 32)) if c in contexts and b in batches]
    if args.tiny:
        cases += [("stacked_scan", 64, 1)]
    for layout, ctx, B in cases:
        weights = per_layer if layout == "per_layer" else params
        # Scatter each sequence over random pages, as a long-running server's pool would be.
        per_seq = (ctx + 128) // S
        pages = rng.permutation(np.arange(1, num_pages))[: B * per_seq].reshape(B, per_seq)
        slot_ids = jnp.arange(B, dtype=jnp.int32)
        page_tables = jnp.asarray(pages, jnp.int32)
        greedy_rows = jax.tree.map(jnp.asarray, sampling_rows([], [], B))
        carry = PlainCarry(
            jnp.asarray(rng.integers(0, cfg.vocab_size, B + 1), jnp.int32),
            jnp.full(B + 1, ctx - 64, jnp.int32).at[B].set(0),
        )
        state = {"s": PlainState(kv, carry, init_penalty_state(B, cfg.vocab_size))}

        def step():
            # The engine's real decode step; timed calls run at contexts ctx - 64 .. ctx + 40.
            state["s"], out = plain_decode_step(
                weights, state["s"], slot_ids, page_tables, greedy_rows, cfg=cfg, sampling="greedy"
            )
            return out.ints

        try:
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            compile_s = time.perf_counter() - t0
            t = timed(step, 5 if args.quick else 20, 3 if args.quick else 5)
        except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
            print(f"FAILED B={B} ctx={ctx} {layout}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            kv = state["s"].target_kv
            continue
        kv = state["s"].target_kv
        kv_bytes = B * ctx * cfg.num_layers * 2 * cfg.kv_size * 2
        bw_floor = (weight_bytes + kv_bytes) / bw
        flop_floor = 2 * B * matmul_params / mm_rate
        row = dict(
            batch=B,
            context=ctx,
            layout=layout,
            step_ms=t * 1e3,
            compile_s=compile_s,
            bandwidth_floor_ms=bw_floor * 1e3,
            matmul_floor_ms=flop_floor * 1e3,
            x_bandwidth_floor=t / bw_floor,
            tokens_per_s=B / t,
        )
        if args.hlo and layout == "per_layer":
            hlo = plain_decode_step.lower(
                weights, state["s"], slot_ids, page_tables, greedy_rows, cfg=cfg, sampling="greedy"
            ).compile()
            name = f"bench_decode{'_' + args.tag if args.tag else ''}_B{B}_ctx{ctx}.hlo.txt"
            with open(os.path.join(args.out, name), "w") as f:
                f.write(hlo.as_text())
            row["hlo"] = name
        if args.profile and layout == "per_layer":
            row["profile"] = profile_calls(step, calls=5)
            kv = state["s"].target_kv  # the profiled calls donated the pool again
            print_summary(f"profile B={B} ctx={ctx}", row["profile"])
        if args.verify_tokens and layout == "per_layer":
            try:
                it, rep = (5, 3) if args.quick else (20, 5)
                row["forward_decode_ms"], kv = forward_ms(weights, cfg, kv, page_tables, ctx, 1, it, rep)
                row["forward_verify_ms"], kv = forward_ms(
                    weights, cfg, kv, page_tables, ctx, args.verify_tokens, it, rep
                )
                row["verify_tokens"] = args.verify_tokens
                row["verify_over_decode"] = row["forward_verify_ms"] / row["forward_decode_ms"]
            except Exception as e:  # noqa: BLE001 - keep the decode row
                print(f"FAILED verify B={B} ctx={ctx}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()

    path = save()
    print(f"\nwrote {path}\n")
    for r in parts:
        if "us" not in r:
            print(f"{r['part']:>14} B={r['batch']:<3} FAILED {json.dumps(r['config'])} {r['error'][:100]}")
            continue
        conf = f" {json.dumps(r['config'])} ok={r['ok']} err={r['max_abs_err']:.1e}" if "config" in r else ""
        print(
            f"{r['part']:>14} B={r['batch']:<3} {r['us']:>9.1f} us {r['TBps']:>5.2f} TB/s {r['x_floor']:>5.2f}x floor"
            f"{conf}"
        )
    if parts:
        print()
        print_gemv_summary(parts)
        print()
    print(
        f"{'B':>4} {'ctx':>5} {'layout':>12} {'step ms':>8} {'floor ms':>8} {'x floor':>7} {'mm floor':>8} {'tok/s':>8}"
    )
    for r in rows:
        print(
            f"{r['batch']:>4} {r['context']:>5} {r['layout']:>12} {r['step_ms']:>8.3f} "
            f"{r['bandwidth_floor_ms']:>8.3f} {r['x_bandwidth_floor']:>7.2f} {r['matmul_floor_ms']:>8.3f} "
            f"{r['tokens_per_s']:>8.0f}"
        )
    ver = [r for r in rows if "verify_over_decode" in r]
    if ver:
        print(f"\n{'B':>4} {'ctx':>5} {'fwd 1 ms':>9} {'fwd N ms':>9} {'N':>3} {'ratio':>6}   (target: <= 1.1)")
        for r in ver:
            print(
                f"{r['batch']:>4} {r['context']:>5} {r['forward_decode_ms']:>9.3f} {r['forward_verify_ms']:>9.3f} "
                f"{r['verify_tokens']:>3} {r['verify_over_decode']:>6.2f}"
            )


if __name__ == "__main__":
    main()

"""Paged attention kernels on the GPU: correctness, time, and distance to the roofline.

For each case (decode at several batch sizes and page sizes, tree verification,
long prefill) every tuning variant of our kernel is checked against the jnp
reference on random bf16 inputs and timed; decode cases also time JAX's bundled
Triton paged_attention on the same problem (in its own layout). Floors: the KV
bytes a call must read over the copy bandwidth measured in this run (bytes read
+ written by a large device-to-device copy), and for prefill the FLOPs over the
measured bf16 matmul rate.

Timing: a jitted fori_loop of `iters` calls, each call's output fed back as the
next query (so nothing is hoisted or deduplicated) and each call reading a
different page-table set, so the KV touched in a row of calls exceeds the
60 MB L2. Several loop executions are queued back to back so host dispatch is
hidden; the median over repeats is reported, per call.

    python -m benchmarks.bench_kernels [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import RESULTS_DIR, Results, copy_bandwidth, matmul_flops
from jspec.kernels.paged_decode import decode_plan, paged_decode
from jspec.kernels.paged_extend import extend_plan, paged_extend
from jspec.kernels.ref import paged_decode_ref, paged_extend_ref

L2_BYTES = 60 << 20
LAYERS, LAYER = 2, 1
TOLERANCE = 2e-2  # bf16 output rounding is ~4e-3 relative
CALLS_PER_ITER = 4  # unrolled inside each loop iteration: the loop's own ~8 us per iteration is amortised


def time_loop(body, carry, consts, iters: int, reps: int) -> tuple[float, float, jax.Array]:
    """(median, min) microseconds per call of body(j, carry, *consts) -> carry, j the call's index,
    and the carry after the warm-up run (one iteration of one call: body(0, carry, *consts)).

    Arrays reach the loop as arguments, never as closed-over constants (which
    would be baked into the executable: GBs of KV, minutes of compile).
    """

    def step(i, c, *consts):
        for u in range(CALLS_PER_ITER):
            c = body(i * CALLS_PER_ITER + u, c, *consts)
        return c

    @jax.jit
    def run(carry, *consts):
        return lax.fori_loop(0, iters, lambda i, c: step(i, c, *consts), carry)

    warm = jax.block_until_ready(run(carry, *consts))  # compile and warm up
    t0 = time.perf_counter()
    jax.block_until_ready(run(carry, *consts))
    one = time.perf_counter() - t0
    queued = max(1, min(50, int(0.03 / max(one, 1e-6))))  # >= ~30 ms per sample
    samples = []
    for _ in range(reps):
        c = carry
        t0 = time.perf_counter()
        for _ in range(queued):
            c = run(c, *consts)
        jax.block_until_ready(c)
        samples.append((time.perf_counter() - t0) / (queued * iters * CALLS_PER_ITER) * 1e6)
    return statistics.median(samples), min(samples), warm


class Problem:
    """Random bf16 paged KV with `sets` disjoint page-table sets of B sequences each."""

    def __init__(
        self, *, batch, ctx, page_size, num_q_heads, num_kv_heads, head_dim, q_rows, layers=LAYERS, seed=0, table=None
    ):
        """table: the page tables' width in tokens (ctx unless given), as a server's tables span
        the context length whatever each sequence holds; the kernels' static split count
        follows it."""
        self.batch, self.ctx, self.page_size = batch, ctx, page_size
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * 2  # K and V, bf16
        self.sets = max(2, min(16, math.ceil(4 * L2_BYTES / self.kv_bytes)))
        max_pages = (table or ctx) // page_size
        num_pages = self.sets * batch * max_pages
        keys = jax.random.split(jax.random.key(seed), 4)
        shape = (layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = jax.random.normal(keys[0], shape, jnp.bfloat16)
        self.v = jax.random.normal(keys[1], shape, jnp.bfloat16)
        self.q = jax.random.normal(keys[2], (q_rows, num_q_heads, head_dim), jnp.bfloat16)
        perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
        self.page_tables = jnp.asarray(perm.reshape(self.sets, batch, max_pages))
        self.seq_lens = jnp.full((batch,), ctx, jnp.int32)
        self.sm_scale = head_dim**-0.5

    def bundled_layout(self):
        """One layer as [Hkv, P, S, D], the bundled kernel's layout."""
        return jnp.transpose(self.k[LAYER], (2, 0, 1, 3)), jnp.transpose(self.v[LAYER], (2, 0, 1, 3))


def rel_err(out, ref) -> float:
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


def run_variant(name, call, ref, problem: Problem, iters, reps, extra, caches=None):
    """call(q, page_tables, k, v) -> out. Returns a result record; never raises."""
    record = {"variant": name, **extra}
    k, v = caches if caches is not None else (problem.k, problem.v)
    try:

        def body(j, q, tables, k, v):
            return call(q, tables[j % problem.sets], k, v).astype(q.dtype)

        # One call per loop (--smoke): the timed program's warm-up run is call(q, tables[0], k, v)
        # itself, checked below; no separate (interpreted on a CPU, slow) call for the check.
        def check(out):
            record["rel_err"] = rel_err(out, ref)
            record["ok"] = bool(record["rel_err"] < TOLERANCE and not bool(jnp.isnan(out.astype(jnp.float32)).any()))

        one_call = iters * CALLS_PER_ITER == 1
        if not one_call:
            check(jax.block_until_ready(call(problem.q, problem.page_tables[0], k, v)))
        median_us, min_us, warm = time_loop(body, problem.q, (problem.page_tables, k, v), iters, reps)
        if one_call:
            check(warm)
        record.update(median_us=median_us, min_us=min_us)
    except Exception as e:  # noqa: BLE001 - a variant that fails on the GPU must not stop the others
        record["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"  {name}: FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
    return record


def decode_case(name, batch, ctx, page_size, variants, *, iters, reps, bundled=True, layers=LAYERS, window=None):
    """window: a sliding window (the kernel reads only each sequence's last window tokens)."""
    p = Problem(
        batch=batch,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        q_rows=batch,
        layers=layers,
    )
    layer = jnp.int32(LAYER)
    win = None if window is None else jnp.int32(window)
    # Compiled as one program: op by op (eager) it compiles each small op for each case's shapes.
    ref = jax.jit(functools.partial(paged_decode_ref, sm_scale=p.sm_scale))(
        p.q, p.k, p.v, layer, p.seq_lens, p.page_tables[0], window=win
    )
    case = dict(
        name=name,
        kind="decode",
        window=window,
        batch=batch,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        kv_bytes=p.kv_bytes if window is None else p.kv_bytes * min(window, ctx) // ctx,
        cache_bytes=2 * p.k.nbytes,
        page_table_sets=p.sets,
        results=[],
    )
    for vname, tuning in variants:
        call = lambda q, pt, k, v, tuning=tuning: paged_decode(
            q, k, v, layer, p.seq_lens, pt, sm_scale=p.sm_scale, window=win, **tuning
        )
        plan = decode_plan(batch, 32, p.k.shape, ctx // page_size, **tuning)._asdict()
        extra = {"tuning": tuning, "plan": plan, "kernel": "jspec"}
        case["results"].append(run_variant(vname, call, ref, p, iters, reps, extra))
        print(f"  {name} {vname}: {case['results'][-1].get('median_us', 'FAILED')}", flush=True)
    if bundled:
        case["results"].append(bundled_decode(p, ref, iters, reps))
        print(f"  {name} bundled: {case['results'][-1].get('median_us', 'FAILED')}", flush=True)
    return case


def bundled_decode(p: Problem, ref, iters, reps):
    """JAX's bundled Triton paged_attention: same pages, its own [Hkv, P, S, D] layout."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        k_pages, v_pages = p.bundled_layout()
    except Exception as e:  # noqa: BLE001 - recorded: the bundled kernel is a comparison, not ours
        return {"variant": "bundled", "kernel": "jax_bundled", "error": f"{type(e).__name__}: {e}"}
    max_pages = p.ctx // p.page_size
    k_splits = min(16, max_pages)
    # Its defaults but with 64-token compute blocks like ours (it needs pages_per_partition % pages_per_block == 0).
    tuning = dict(
        block_h=16,
        pages_per_compute_block=max(1, min(64 // p.page_size, max_pages // k_splits)),
        k_splits=k_splits,
        num_warps=8,
        num_stages=2,
    )
    interpret = jax.default_backend() != "gpu"  # only for --smoke on a CPU

    def call(q, pt, k_pages, v_pages):
        # It applies no softmax scale of its own: fold it into q (a [B, Hq, D] multiply).
        q = (q.astype(jnp.float32) * p.sm_scale).astype(q.dtype)
        return paged_attention(q, k_pages, v_pages, pt, p.seq_lens, interpret=interpret, **tuning)

    extra = {"tuning": tuning, "kernel": "jax_bundled"}
    return run_variant("bundled", call, ref, p, iters, reps, extra, caches=(k_pages, v_pages))


def random_tree_mask(batch: int, q_len: int) -> jax.Array:
    """A draft-tree-like mask: each token sees itself and a random 40% of the earlier ones."""
    rng = np.random.default_rng(1)
    return jnp.asarray(np.tril(rng.random((batch, q_len, q_len)) < 0.4) | np.eye(q_len, dtype=bool)[None])


def extend_flops(batch, q_len, ctx, mask, *, window=None, num_q_heads=32, head_dim=128) -> float:
    """The two matmuls' FLOPs over the (query, key) pairs an extend call's masks leave visible:
    a prefix of ctx - q_len keys, then the tree mask's pairs or the causal triangle."""
    if mask is not None:
        visible = float(np.asarray(mask).sum()) / batch + (ctx - q_len) * q_len
    else:
        visible = (ctx - q_len) * q_len + q_len * (q_len + 1) / 2
    if window is not None:  # each query sees at most its last window positions
        positions = np.arange(ctx - q_len, ctx)
        visible = float(np.minimum(positions + 1, window).sum())
    return 4 * batch * visible * num_q_heads * head_dim


def extend_case(
    name, batch, q_len, ctx, page_size, variants, *, tree, iters, reps, window=None, heads=(32, 8, 128), table=None
):
    """window: a sliding window narrower than ctx (each query reads its last window keys);
    heads: (query heads, KV heads, head dim), the 8B's unless given; table: the page tables'
    width in tokens (Problem)."""
    num_q_heads, num_kv_heads, head_dim = heads
    p = Problem(
        batch=batch,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_rows=batch * q_len,
        table=table,
    )
    layer = jnp.int32(LAYER)
    query_start = jnp.arange(batch + 1, dtype=jnp.int32) * q_len
    mask = random_tree_mask(batch, q_len) if tree else None
    win = None if window is None else jnp.int32(window)
    ref = jax.jit(functools.partial(paged_extend_ref, sm_scale=p.sm_scale, max_q_len=q_len))(
        p.q, p.k, p.v, layer, p.seq_lens, p.page_tables[0], query_start, mask=mask, window=win
    )
    flops = extend_flops(batch, q_len, ctx, mask, window=window, num_q_heads=num_q_heads, head_dim=head_dim)
    case = dict(
        name=name,
        kind="extend_tree" if tree else "extend_causal",
        window=window,
        batch=batch,
        q_len=q_len,
        ctx=ctx,
        page_size=page_size,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        kv_bytes=p.kv_bytes,
        flops=flops,
        page_table_sets=p.sets,
        table_tokens=table or ctx,
        results=[],
    )
    for vname, tuning in variants:
        call = lambda q, pt, k, v, tuning=tuning: paged_extend(
            q,
            k,
            v,
            layer,
            p.seq_lens,
            pt,
            query_start,
            sm_scale=p.sm_scale,
            max_q_len=q_len,
            mask=mask,
            window=win,
            **tuning,
        )
        plan = extend_plan(
            batch, num_q_heads, p.k.shape, p.page_tables.shape[-1], q_len, batch * q_len, **tuning
        )._asdict()
        extra = {"tuning": tuning, "plan": plan, "kernel": "jspec"}
        case["results"].append(run_variant(vname, call, ref, p, iters, reps, extra))
        print(f"  {name} {vname}: {case['results'][-1].get('median_us', 'FAILED')}", flush=True)
    return case


def decode_variants(quick, small_batch):
    base = [("default", {})]
    if quick:
        return base
    if small_batch:
        return base + [
            ("splits8", dict(num_splits=8, min_split_tokens=64)),
            ("splits32", dict(num_splits=32, min_split_tokens=64)),
            ("n128", dict(block_n=128)),
            ("n128_w8", dict(block_n=128, num_warps=8)),
        ]
    return base + [
        ("n32", dict(block_n=32)),
        ("n128", dict(block_n=128)),
        ("n128_w8", dict(block_n=128, num_warps=8)),
        ("stages3", dict(num_stages=3)),
        ("n32_stages4", dict(block_n=32, num_stages=4)),
        ("splits1", dict(num_splits=1)),
        ("splits2", dict(num_splits=2)),
        ("splits8", dict(num_splits=8)),
    ]


def tree_variants(quick):
    base = [("default", {})]
    if quick:
        return base
    return base + [
        ("splits1", dict(num_splits=1)),
        ("splits8", dict(num_splits=8)),
        ("n128", dict(block_n=128)),
        ("n32_stages3", dict(block_n=32, num_stages=3)),
    ]


def small_verify_variants():
    """Query-block heights and splits for a short chain on few sequences, where one block of
    every token leaves most SMs idle (there the default plan shrinks the block and splits the
    context)."""
    return (
        [("default", {})]
        + [
            (f"m{m}_splits{n}", dict(block_m=m, num_splits=n, min_split_tokens=64))
            for m in (16, 32, 64)
            for n in (1, 4, 8)
        ]
        + [("m64_w8", dict(block_m=64, num_warps=8)), ("m32_n64", dict(block_m=32, block_n=64))]
    )


def prefill_variants(quick):
    base = [("default", {})]
    if quick:
        return base
    return base + [
        ("m64_w4", dict(block_m=64, num_warps=4)),
        ("m128_n128_w8", dict(block_n=128, num_warps=8)),
        ("m128_n64_w4", dict(num_warps=4)),
        ("stages3", dict(num_stages=3)),
    ]


def summarize(record, case, copy_bw, mm_flops):
    t = record.get("median_us")
    if t is None:
        return
    seconds = t * 1e-6
    record["achieved_tbps"] = case["kv_bytes"] / seconds / 1e12
    record["fraction_of_copy_bw"] = case["kv_bytes"] / seconds / copy_bw
    if "flops" in case:
        record["achieved_tflops"] = case["flops"] / seconds / 1e12
        record["fraction_of_matmul"] = case["flops"] / seconds / mm_flops


def print_table(cases):
    print(f"\n{'case':34s} {'variant':14s} {'us':>9s} {'TB/s':>6s} {'%copy':>6s} {'TFLOP/s':>8s} {'rel_err':>8s}")
    for case in cases:
        print(f"{'':34s} roofline {case['roofline_us']:.1f} us")
        for r in case["results"]:
            if "median_us" not in r:
                print(f"{case['name']:34s} {r['variant']:14s} FAILED: {r.get('error', '')[:60]}")
                continue
            tf = f"{r['achieved_tflops']:8.1f}" if "achieved_tflops" in r else f"{'':8s}"
            print(
                f"{case['name']:34s} {r['variant']:14s} {r['median_us']:9.1f} {r['achieved_tbps']:6.2f} "
                f"{100 * r['fraction_of_copy_bw']:5.1f}% {tf} {r.get('rel_err', float('nan')):8.1e}"
            )


def run_plans(plans, cases: list, save, copy_bw: float, mm_flops: float) -> None:
    """Sets up and times each case (a plan), graded against its floors, saving after each so a
    later failure keeps the earlier rows; prints the table last."""
    for plan in plans:
        try:
            case = plan()
        except Exception as e:  # noqa: BLE001 - one case that fails to set up must not stop the others
            print(f"case failed to set up: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}", flush=True)
            continue
        case["roofline_us"] = case["kv_bytes"] / copy_bw * 1e6
        if "flops" in case:
            case["compute_floor_us"] = case["flops"] / mm_flops * 1e6
        for r in case["results"]:
            summarize(r, case, copy_bw, mm_flops)
        cases.append(case)
        save()
    path = save()
    print(f"wrote {path}")
    print_table(cases)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true", help="default tuning only, fewer repeats")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check this script on a CPU")
    parser.add_argument(
        "--verify-small",
        action="store_true",
        help="only the SmolLM2 shape's verify (9 / 3 heads of 64; 16, 8, 4 tokens at B=1, 16 at B=16): tiles and splits",
    )
    args = parser.parse_args()
    iters, reps = (3, 3) if args.quick else (5, 4)
    # --smoke divides contexts and batches so interpret mode finishes in minutes.
    shrink = 64 if args.smoke else 1
    if args.smoke:
        iters, reps = 1, 1
        # An interpreted kernel compiles once per unrolled call: one call per iteration keeps
        # the dry run's compile short (the loop's own overhead means nothing on a CPU).
        global CALLS_PER_ITER
        CALLS_PER_ITER = 1

    device = jax.devices()[0]
    print(f"device: {device.device_kind}, jax {jax.__version__}", flush=True)
    copy_bw = copy_bandwidth((1 << 31) // shrink**2)
    mm_flops = matmul_flops(8192 // shrink)
    print(
        f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write), bf16 matmul {mm_flops / 1e12:.0f} TFLOP/s", flush=True
    )

    def ctx(n):
        return max(64, n // shrink)

    def batch(n):
        return max(1, n // (8 if args.smoke else 1))

    big, small = decode_variants(args.quick, False), decode_variants(args.quick, True)
    # The full sweep at page size 16; the other page sizes get the tile-size alternatives only.
    tiles_only = [v for v in big if v[0] in ("default", "n32", "n128", "stages3")]
    plans = [
        lambda: decode_case("decode_b32_ctx4096_s16", batch(32), ctx(4096), 16, big, iters=iters, reps=reps),
        lambda: decode_case(
            "decode_b32_ctx4096_s1", batch(32), ctx(4096), 1, tiles_only, iters=iters, reps=reps, bundled=not args.quick
        ),
        lambda: decode_case(
            "decode_b32_ctx4096_s64",
            batch(32),
            ctx(4096),
            64,
            tiles_only,
            iters=iters,
            reps=reps,
            bundled=not args.quick,
        ),
        # A cache over 4 GiB makes the kernel address KV with 64-bit offsets, as a real pool would.
        lambda: decode_case(
            "decode_b32_ctx4096_s16_cache9GB",
            batch(32),
            ctx(4096),
            16,
            big[:1],
            iters=iters,
            reps=reps,
            bundled=False,
            layers=9,
        ),
        lambda: decode_case(
            "decode_b1_ctx4096_s16", 1, ctx(4096), 16, small, iters=iters, reps=reps, bundled=not args.quick
        ),
        lambda: decode_case(
            "decode_b8_ctx1024_s16", batch(8), ctx(1024), 16, small, iters=iters, reps=reps, bundled=not args.quick
        ),
        lambda: extend_case(
            "tree_b32_q8_ctx4096_s16",
            batch(32),
            8,
            ctx(4096),
            16,
            tree_variants(args.quick),
            tree=True,
            iters=iters,
            reps=reps,
        ),
        lambda: extend_case(
            "prefill_b1_q2048_ctx2048_s16",
            1,
            ctx(2048),
            ctx(2048),
            16,
            prefill_variants(args.quick),
            tree=False,
            iters=iters,
            reps=reps,
        ),
        # Sliding windows (Mistral / Gemma style) an eighth of the context: the kernels read
        # only the window, so time should follow window / ctx of the plain cases above.
        lambda: decode_case(
            "decode_b32_ctx4096_s16_window512",
            batch(32),
            ctx(4096),
            16,
            big[:1],
            iters=iters,
            reps=reps,
            bundled=False,
            window=ctx(4096) // 8,
        ),
        lambda: extend_case(
            "prefill_b1_q2048_ctx2048_s16_window256",
            1,
            ctx(2048),
            ctx(2048),
            16,
            prefill_variants(True),
            tree=False,
            iters=iters,
            reps=reps,
            window=ctx(2048) // 8,
        ),
    ]
    if args.verify_small:
        # DFLASH's block of 16 and 8 and EAGLE-3's 4 verified over a SmolLM2-sized context, the
        # shapes whose B=1 iteration the verify kernel dominates (a random tree mask: the
        # kernel's cost does not depend on which pairs the mask keeps).
        plans = [
            lambda b=b, q=q: extend_case(
                f"verify_b{b}_q{q}_ctx512_s16_smollm2",
                b if not args.smoke else 1,
                q,
                ctx(512) if not args.smoke else 64,
                16,
                small_verify_variants()[: 3 if args.smoke else None],
                tree=True,
                iters=iters,
                reps=reps,
                heads=(9, 3, 64),
            )
            for b, q in ((1, 16), (1, 8), (1, 4), (16, 16))
        ][: 1 if args.smoke else None]
        # As served: the page tables span the embedded model's context, so the plan's static
        # split count follows the width while the runtime splits follow the 512 tokens held.
        # Against the plan before short queries put programs first (64-row block, 256-token
        # splits) and the measured winner at a 512-token table.
        served = [("default", {}), ("before", dict(block_m=64, min_split_tokens=256))]
        served += [("m16_splits4", dict(block_m=16, num_splits=4))]
        plans += [
            lambda b=b: extend_case(
                f"verify_b{b}_q16_ctx512_table8192_s16_smollm2",
                b if not args.smoke else 1,
                16,
                ctx(512) if not args.smoke else 64,
                16,
                served[: 2 if args.smoke else None],
                tree=True,
                iters=iters,
                reps=reps,
                heads=(9, 3, 64),
                table=ctx(8192) if not args.smoke else 256,
            )
            for b in (1, 16)
        ][: 1 if args.smoke else None]
    # Per-iteration cost of the timing loop itself: a trivial body on a decode-sized q.
    q_small = jnp.ones((32, 32, 128), jnp.bfloat16)
    loop_floor_us, _, _ = time_loop(lambda j, q: q * jnp.bfloat16(0.5) + q, q_small, (), iters, reps)
    print(f"timing-loop floor {loop_floor_us:.1f} us per call (a trivial kernel)", flush=True)

    results = Results(
        args.out,
        "bench_kernels_verify_small" if args.verify_small else "bench_kernels",
        {
            "iters_per_loop": iters,
            "repeats": reps,
            "quick": args.quick,
            "smoke": args.smoke,
            "dtype": "bfloat16",
            "layers": LAYERS,
            "tolerance": TOLERANCE,
        },
    )
    cases = []

    def save():
        return results.write(
            copy_bandwidth_tbps=copy_bw / 1e12, matmul_tflops=mm_flops / 1e12, loop_floor_us=loop_floor_us, cases=cases
        )

    run_plans(plans, cases, save, copy_bw, mm_flops)


if __name__ == "__main__":
    main()

"""What one kernel call costs the host, per Pallas backend: a program of N add-and-norm (or
paged decode) calls.

The 8B server on the Mosaic GPU kernels spends ~1 ms more of host time launching each step
than on the Triton-backend ones, with XLA's command buffers on or off (benchmarks/NOTES.md,
bench_kernels_mgpu). This separates the kernel family from everything else in a step: one
jitted program chains N calls of the same add-and-norm ([rows, width], bf16) on
- xla: XLA's ops (kernels/rms_norm.add_rms_norm_ref),
- pallas: the Triton-backend kernel (kernels/rms_norm.py),
- mosaic: the Mosaic GPU kernel (kernels/rms_norm_mgpu.py),
with its state donated as the engine's is, and times, for each N, the host's dispatch (the
call's return, the device idle before it) and the device's time per program (back-to-back
calls). The slope of dispatch time over N is the host's cost of one call of that family.

--kernel paged_decode chains N calls of the paged decode attention instead, call i reading
layer i of a KV pool of N layers (page 16, the 8B's heads: 32 query and 8 KV heads of 128,
--rows sequences of --context tokens), each call's output the next one's query, the pool
donated and returned as a step's is: the attention's calls carry the pool, the page table and
the lengths, which an add-and-norm's do not (kernels/ref.py, paged_decode.py,
paged_decode_mgpu.py).

    python -m benchmarks.bench_call_cost [--kernel add_norm|paged_decode] [--calls 1,16,64,128]
        [--width 4096] [--rows 1] [--context 512] [--backends xla,pallas,mosaic] [--moving] [--out DIR] [--tiny]

--moving: one operand every call reads (the add-and-norm's weight, the decode's lengths) comes
back from each program as a new buffer and goes into the next, so its address changes every
call, as a step's carry does between steps. XLA then updates its command buffers before each
launch: a kernel node has its pointers swapped, a custom call (Mosaic GPU's) is captured again.
Written to NAME_moving.json.

--tiny: one and two calls, a 64-wide row (a CPU dry run: Pallas interpreted, Mosaic GPU
skipped, there being no Mosaic lowering for the CPU outside its interpreter).
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import RESULTS_DIR, Results, int_list, median_ms, timed
from jspec.kernels.paged_decode import paged_decode
from jspec.kernels.paged_decode_mgpu import paged_decode_mgpu
from jspec.kernels.ref import paged_decode_ref
from jspec.kernels.rms_norm import add_rms_norm, add_rms_norm_ref
from jspec.kernels.rms_norm_mgpu import add_rms_norm_mgpu

EPS = 1e-6
KERNELS = {
    "xla": lambda x, y, w: add_rms_norm_ref(x, y, w, EPS),
    "pallas": functools.partial(add_rms_norm, eps=EPS),
    "mosaic": functools.partial(add_rms_norm_mgpu, eps=EPS),
}

DECODE_KERNELS = {"xla": paged_decode_ref, "pallas": paged_decode, "mosaic": paged_decode_mgpu}
PAGE_SIZE, Q_HEADS, KV_HEADS, HEAD_DIM = 16, 32, 8, 128


def chain(kernel, calls: int):
    """A donating program of `calls` add-and-norms, each fed the last one's outputs (so none
    can be dropped or reordered), as a step feeds its layers; it also returns the weight, as a
    new buffer (an output never aliases an argument that is not donated)."""

    def program(x, y, w):
        for _ in range(calls):
            x, y = kernel(x, y, w)
        return x, y, w

    return jax.jit(program, donate_argnums=(0, 1))


def time_chain(calls: int, call, ready) -> dict:
    """The host's dispatch (the call's return, the device idle before it) and the device's time
    per program of `call`, a donating chain of `calls` kernel calls; `ready` waits for its output."""
    jax.block_until_ready(call())  # compiles
    dispatch = median_ms(call, 50, ready)
    device = timed(call, 20, 5) * 1e3
    return dict(calls=calls, dispatch_ms=dispatch, program_ms=device)


def measure(kernel, calls: int, rows: int, width: int, moving: bool) -> dict:
    key = jax.random.split(jax.random.key(calls), 3)
    state = {
        "x": jax.random.normal(key[0], (rows, width), jnp.bfloat16),
        "y": jax.random.normal(key[1], (rows, width), jnp.bfloat16),
    }
    state["w"] = jax.random.normal(key[2], (width,), jnp.bfloat16)
    program = chain(kernel, calls)

    def call():
        state["x"], state["y"], w = program(state["x"], state["y"], state["w"])
        if moving:
            state["w"] = w
        return state["x"]

    return time_chain(calls, call, lambda: jax.block_until_ready(state["x"]))


def measure_decode(kernel, calls: int, rows: int, context: int, moving: bool) -> dict:
    """measure's figures for a program of `calls` paged decodes, one a layer of the pool."""
    pages = -(-context // PAGE_SIZE)
    key = jax.random.split(jax.random.key(calls), 3)
    shape = (calls, rows * pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    state = {
        "q": jax.random.normal(key[0], (rows, Q_HEADS, HEAD_DIM), jnp.bfloat16),
        "k": jax.random.normal(key[1], shape, jnp.bfloat16),
        "v": jax.random.normal(key[2], shape, jnp.bfloat16),
    }
    state["seq_lens"] = jnp.full((rows,), context, jnp.int32)
    tables = jnp.arange(rows * pages, dtype=jnp.int32).reshape(rows, pages)

    def program(q, k, v, seq_lens, tables):
        for layer in range(calls):
            q = kernel(q, k, v, jnp.int32(layer), seq_lens, tables, sm_scale=HEAD_DIM**-0.5)
        return q, k, v, seq_lens

    step = jax.jit(program, donate_argnums=(0, 1, 2))

    def call():
        state["q"], state["k"], state["v"], seq_lens = step(
            state["q"], state["k"], state["v"], state["seq_lens"], tables
        )
        if moving:
            state["seq_lens"] = seq_lens
        return state["q"]

    return time_chain(calls, call, lambda: jax.block_until_ready(state["q"]))


def slope_us(rows: list[dict], key: str) -> float | None:
    """Least-squares microseconds per call of `key` over the row counts."""
    if len(rows) < 2:
        return None
    n = np.array([r["calls"] for r in rows], float)
    t = np.array([r[key] for r in rows], float)
    return float(np.polyfit(n, t, 1)[0]) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=["add_norm", "paged_decode"], default="add_norm")
    ap.add_argument("--calls", type=int_list, default=[1, 16, 64, 128])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=512, help="paged_decode: tokens a sequence")
    ap.add_argument("--backends", default="xla,pallas,mosaic")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--moving", action="store_true", help="an operand of every call at a new address each call")
    ap.add_argument("--tiny", action="store_true", help="a CPU dry run: 1 and 2 calls, 64 wide")
    args = ap.parse_args()
    calls, width = ([1, 2], 64) if args.tiny else (args.calls, args.width)
    context = 32 if args.tiny else args.context
    backends = args.backends.split(",")
    if jax.default_backend() != "gpu":
        backends = [b for b in backends if b != "mosaic"]
    decode = args.kernel == "paged_decode"
    settings = dict(
        kernel=args.kernel,
        calls=calls,
        rows=args.rows,
        dtype="bfloat16",
        backends=backends,
        moving=args.moving,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        allocator=os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
    )
    if decode:
        settings |= dict(context=context, page_size=PAGE_SIZE, heads=[Q_HEADS, KV_HEADS, HEAD_DIM])
    else:
        settings |= dict(width=width)
    name = "bench_call_cost" + ("_paged_decode" if decode else "") + ("_moving" if args.moving else "")
    results = Results(args.out, name, settings)
    table = []
    for backend in backends:
        if decode:
            rows = [measure_decode(DECODE_KERNELS[backend], n, args.rows, context, args.moving) for n in calls]
        else:
            rows = [measure(KERNELS[backend], n, args.rows, width, args.moving) for n in calls]
        table.append(
            dict(
                backend=backend,
                rows=rows,
                host_us_per_call=slope_us(rows, "dispatch_ms"),
                device_us_per_call=slope_us(rows, "program_ms"),
            )
        )
        path = results.write(backends=table)
    print(f"\n{'backend':>8} {'calls':>6} {'dispatch ms':>12} {'program ms':>11}")
    for b in table:
        for r in b["rows"]:
            print(f"{b['backend']:>8} {r['calls']:>6} {r['dispatch_ms']:>12.3f} {r['program_ms']:>11.3f}")
    for b in table:
        host, device = b["host_us_per_call"], b["device_us_per_call"]
        print(f"{b['backend']}: host {host:.2f} us a call, device {device:.2f} us a call")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""PD disaggregation on one GPU, two processes: time to first decode token and KV transfer
bandwidth for 1k- and 8k-token prompts, EAGLE-3 on, against one colocated engine.

This process is the decode engine (jspec.disaggregation.DecodeEngine, overlap loop); it
starts a second copy of itself as the prefill engine (--role prefill: PrefillEngine behind
a PrefillServer) and waits for its bootstrap port. Both hold the same random weights (same
seed). Each process gets --mem-fraction of the GPU (XLA_PYTHON_CLIENT_MEM_FRACTION), so
the two fit side by side.

Per prompt length and transfer backend (socket, shm), after untimed runs that compile
every program the requests meet, --repeats requests one at a time:
- ttft_s: submit -> the first token on the decode side (prefill + read-out + transfer);
- first_decode_token_s: submit -> the first token the decode engine itself produced
  (the figure that matters: the request is decoding in the decode engine's loop);
- transfer_bytes: one request's arrays (target + draft KV of the prompt, the slot rows);
- wire_s / wire_GBps: the link alone (the arrays on the prefill host -> on the decode host);
- d2h_GBps / h2d_GBps: the two host-staging legs, timed apart in this process on arrays of
  the transferred shapes (inside the loop the device->host copy overlaps the prefill step,
  which it waits on, so it cannot be timed there without a sync);
- staged_GBps = bytes / (d2h + wire + h2d): what the whole host-staged path moves per second;
- readout_to_host_s: the read-out dispatched (with the prompt's last prefill step) -> the
  arrays on the prefill host: that step's compute plus the device->host copy;
- stage_s: the decode side's reader thread checking, padding and uploading the arrays (the
  upload is asynchronous: this is mostly the host part).
The colocated row runs the same requests through one jspec.Engine (prefill and decode in
one loop) for comparison. Medians over the repeats; the JSON goes to
benchmarks/results/bench_pd.json.

    python -m benchmarks.bench_pd [--model small|8b] [--prompt-lens 1024,8192] [--repeats 5]
    python -m benchmarks.bench_pd --tiny        # a CPU dry run of the script (tiny model, short prompts)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import (
    EAGLE3_8B_CTX,
    LLAMA_8B_CTX,
    REPO_ROOT,
    RESULTS_DIR,
    SMALL,
    SMALL_DRAFT,
    TINY,
    TINY_DRAFT,
    Results,
    median,
    random_params,
)
from jspec.checkpoint.eagle import init_random_draft_params

SPEC = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=1, num_draft_tokens=4)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=["small", "8b"], default="8b")
    ap.add_argument("--prompt-lens", default="1024,8192")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="socket,shm")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--chunked-prefill-size", type=int, default=4096)
    ap.add_argument("--mem-fraction", type=float, default=0.42, help="GPU memory per process")
    ap.add_argument("--no-colocated", action="store_true", help="skip the one-engine comparison")
    ap.add_argument("--tiny", action="store_true", help="tiny model, short prompts: a CPU dry run")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--name", default="bench_pd", help="JSON file name under --out")
    return ap.parse_args(argv)


def setup(args):
    """(model, draft, prompt lengths, engine keywords): identical in both processes."""
    if args.tiny:
        cfg, dcfg, lens, dtype = TINY, TINY_DRAFT, [32, 128], jnp.float32
    else:
        cfg, dcfg = {"small": (SMALL, SMALL_DRAFT), "8b": (LLAMA_8B_CTX, EAGLE3_8B_CTX)}[args.model]
        lens, dtype = [int(x) for x in args.prompt_lens.split(",")], jnp.bfloat16
    ctx = max(lens) + args.new_tokens + 64
    cfg = dataclasses.replace(cfg, max_position_embeddings=ctx)
    dcfg = dataclasses.replace(dcfg, max_position_embeddings=max(dcfg.max_position_embeddings, ctx))
    params = random_params(cfg, dtype)
    dparams = init_random_draft_params(dcfg, jax.random.key(3), dtype)
    kw = dict(
        speculative=SPEC,
        draft=(dcfg, dparams),
        page_size=args.page_size,
        max_running_requests=4,
        max_total_tokens=2 * ctx + 1024,
        chunked_prefill_size=args.chunked_prefill_size,
        disable_radix_cache=True,
    )  # every repeat must prefill, not hit the cache
    if args.tiny:
        kw["attention_backend"] = "reference"
    return (cfg, params), lens, kw


def run_prefill(args) -> None:
    from jspec.disaggregation.prefill import PrefillEngine, PrefillServer

    model, _, kw = setup(args)
    server = PrefillServer(PrefillEngine(model, **kw), "127.0.0.1", args.port)
    print(f"listening on {server.addr}", flush=True)
    server.serve_forever()


def one_request(engine, prompt, new_tokens):
    """Submits one request and runs the loop to its end: (ttft, time to first decode token)."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, jspec.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    ttft = first_decode = None
    done = False
    while not done:
        for out in engine.step():
            if out.rid != rid:
                continue
            if out.error:
                raise RuntimeError(out.error)
            now = time.perf_counter() - t0
            if ttft is None and out.completion_tokens >= 1:
                ttft = now
            if first_decode is None and out.completion_tokens >= 2:
                first_decode = now
            done = out.finished
    engine.drain()
    return ttft, first_decode


def staging_legs(engine, n: int, repeats: int) -> tuple[float, float]:
    """Median seconds of device->host and host->device copies of one n-token request's arrays."""
    from jspec.disaggregation import kv_io
    from jspec.disaggregation.transfer import dtype

    shapes = [
        ((s[0], n, *s[1:]) if kind == "paged" else tuple(s), dtype(dt))
        for kind, s, dt in kv_io.layout(engine.worker.state)
    ]
    host = [np.ones(shape, dt) for shape, dt in shapes]
    d2h, h2d = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dev = jax.block_until_ready(jax.device_put(host))
        h2d.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        [np.array(a) for a in dev]  # a copy: on the CPU np.asarray would be a view
        d2h.append(time.perf_counter() - t0)
    return median(d2h[1:]), median(h2d[1:])


def pd_rows(engine, backend, lens, rng, vocab, rows, save, args) -> None:
    """The PD rows of one transfer backend."""
    for n in lens:
        prompts = [list(map(int, rng.integers(0, vocab, n))) for _ in range(args.repeats + 2)]
        for p in prompts[:2]:  # untimed: compiles what these requests meet, on both sides
            one_request(engine, p, args.new_tokens)
        engine.scheduler.transfers.clear()
        times = [one_request(engine, p, args.new_tokens) for p in prompts[2:]]
        tr = engine.scheduler.transfers
        wire = median([t.t_received - t.t_sent for t in tr])
        nbytes = tr[0].nbytes
        d2h, h2d = staging_legs(engine, n, args.repeats)
        row = dict(
            mode="pd",
            backend=backend,
            prompt_len=n,
            ttft_s=median([t for t, _ in times]),
            first_decode_token_s=median([d for _, d in times]),
            transfer_bytes=nbytes,
            wire_s=wire,
            wire_GBps=nbytes / wire / 1e9,
            d2h_GBps=nbytes / d2h / 1e9,
            h2d_GBps=nbytes / h2d / 1e9,
            staged_GBps=nbytes / (d2h + wire + h2d) / 1e9,
            readout_to_host_s=median([t.t_sent - t.t_extract for t in tr]),
            stage_s=median([t.t_staged - t.t_received for t in tr]),
            staged_on_device=sum(t.on_device for t in tr) / len(tr),
            admit_dispatch_s=median([t.t_admitted - t.t_received for t in tr]),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
        save()
    engine.check_idle_no_leaks()


def run_decode(args) -> None:
    from jspec.disaggregation.decode import DecodeEngine

    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}", flush=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(args.mem_fraction))
    argv = [
        sys.executable,
        "-m",
        "benchmarks.bench_pd",
        "--role",
        "prefill",
        "--port",
        "0",
        "--model",
        args.model,
        "--prompt-lens",
        args.prompt_lens,
        "--new-tokens",
        str(args.new_tokens),
        "--page-size",
        str(args.page_size),
        "--chunked-prefill-size",
        str(args.chunked_prefill_size),
    ] + (["--tiny"] if args.tiny else [])
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    rows = []
    model, lens, kw = setup(args)
    settings = dict(
        model="tiny" if args.tiny else args.model,
        prompt_lens=lens,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        speculative="EAGLE3 (3,1,4)",
        mem_fraction=args.mem_fraction,
        processes="2 on one device",
    )
    results = Results(args.out, "bench_pd", settings, file_name=args.name)

    def save():
        return results.write(rows=rows)

    try:
        line = child.stdout.readline()
        if not line.startswith("listening on "):
            raise SystemExit(f"the prefill process did not start: {line!r}")
        addr = line.split()[-1]
        rng = np.random.default_rng(0)
        vocab = model[0].vocab_size
        for backend in args.backends.split(","):
            engine = DecodeEngine(model, prefill_addrs=[addr], transfer_backend=backend, **kw)
            try:
                pd_rows(engine, backend, lens, rng, vocab, rows, save, args)
            except RuntimeError as e:  # e.g. a /dev/shm too small for the shm backend: keep the other rows
                rows.append(dict(mode="pd", backend=backend, error=str(e)))
                print(f"{backend}: {e}", flush=True)
                save()
            engine.close()
            del engine
            gc.collect()
        if not args.no_colocated:
            engine = jspec.Engine(model, **kw)
            for n in lens:
                prompts = [list(map(int, rng.integers(0, vocab, n))) for _ in range(args.repeats + 2)]
                for p in prompts[:2]:
                    one_request(engine, p, args.new_tokens)
                times = [one_request(engine, p, args.new_tokens) for p in prompts[2:]]
                row = dict(
                    mode="colocated",
                    backend=None,
                    prompt_len=n,
                    ttft_s=median([t for t, _ in times]),
                    first_decode_token_s=median([d for _, d in times]),
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
    finally:
        child.kill()
        child.wait()
    path = save()
    print(f"\nwrote {path}\n")
    nan = float("nan")
    print(
        f"{'mode':>9} {'backend':>7} {'prompt':>6} {'ttft ms':>8} {'1st dec ms':>10} {'MB':>7} {'wire GB/s':>9} "
        f"{'d2h GB/s':>8} {'h2d GB/s':>8} {'staged':>6}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:>9} {r['backend']!s:>7} failed: {r['error']}")
            continue
        print(
            f"{r['mode']:>9} {r['backend']!s:>7} {r['prompt_len']:>6} {r['ttft_s'] * 1e3:>8.2f} "
            f"{r['first_decode_token_s'] * 1e3:>10.2f} {r.get('transfer_bytes', 0) / 1e6 or nan:>7.1f} "
            f"{r.get('wire_GBps', nan):>9.2f} {r.get('d2h_GBps', nan):>8.2f} {r.get('h2d_GBps', nan):>8.2f} "
            f"{r.get('staged_GBps', nan):>6.2f}"
        )


def main():
    args = parse_args()
    # Read when the backend starts (the first jax.devices()), not when jax is imported.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))
    (run_prefill if args.role == "prefill" else run_decode)(args)


if __name__ == "__main__":
    main()

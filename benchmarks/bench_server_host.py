"""The server's own host cost per streamed token: CPU seconds of the HTTP thread (the event loop:
routes, streams, server-sent events) and of the engine loop's thread, per output token, while
bench_serving drives `jspec serve` at fixed concurrency. `jspec serve` runs the engine in a
process of its own (/debug/state names its pid and the loop's thread); with --engine-in-thread
(--server-flags) both threads share one interpreter and its GIL, and what the HTTP side spends
per token is time the engine loop can lose at high concurrency. "http process" is all of the
server's process (the event loop and the threads that carry the engine's pipe); "process" sums
the server's and the engine's processes; "client" is bench_serving's own, in this process. Read from
/proc (Linux), on a tiny model whose device step is cheap.

    python -m benchmarks.bench_server_host [--concurrency 16,64] [--backends sglang,openai]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import types

from benchmarks.bench_serving import random_requests, run
from benchmarks.common import RESULTS_DIR, Results
from benchmarks.serving_curve import cpu_clocks, get_json, process_cpu_s, start_server, stop_server
from jspec.checkpoint.tiny import make_tiny_model


def processes_cpu_s(pids) -> float:
    return sum(process_cpu_s(p) for p in pids)


def drive(url: str, backend: str, served: dict, concurrency: int, prompts: int, a) -> dict:
    """bench_serving's run (as serving_curve drives it): `prompts` random prompts, `concurrency` in flight."""
    client = types.SimpleNamespace(
        base_url=url,
        backend=backend,
        model=served["id"],
        dataset_name="random",
        max_concurrency=concurrency,
        seed=0,
        http_client=a.http_client,
    )
    vocab = served.get("vocab_size", 256)
    requests = random_requests(prompts, a.input_len, a.output_len, 1.0, vocab, seed=concurrency)
    return asyncio.run(run(client, requests, float("inf")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--backends", default="sglang,openai")
    ap.add_argument("--prompts-per-c", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument(
        "--server-flags", default="", help="more `jspec serve` flags, e.g. --server-flags=--engine-in-thread"
    )
    ap.add_argument("--http-client", choices=["auto", "aiohttp", "httpx"], default="auto")
    ap.add_argument("--name", default="bench_server_host")
    ap.add_argument("--out", default=RESULTS_DIR)
    a = ap.parse_args()
    model = make_tiny_model(tempfile.mkdtemp() + "/tiny", max_position_embeddings=4096)
    concurrency = [int(c) for c in a.concurrency.split(",")]
    log = os.path.join(tempfile.mkdtemp(), "server.log")
    proc, healthy_s = start_server(
        f"--model-path {model} --max-running-requests {max(concurrency)} {a.server_flags}", a.port, log, timeout=300
    )
    results = Results(a.out, a.name, vars(a))
    rows = []
    try:
        pid, url = proc.pid, f"http://127.0.0.1:{a.port}"
        state = get_json(url + "/debug/state")
        processes = {pid, state["engine_pid"]}

        def clocks() -> dict:
            return {**cpu_clocks(pid, state), "processes": processes_cpu_s(processes)}

        served = get_json(url + "/v1/models")["data"][0]
        for backend in a.backends.split(","):
            for c in concurrency:
                n = c * a.prompts_per_c
                drive(url, backend, served, c, c, a)  # compiles what this c needs
                before = clocks()
                r = drive(url, backend, served, c, n, a)
                after = clocks()
                tokens = r["output_token_throughput"] * r["duration_s"]
                per_token = {k: 1e6 * (after[k] - before[k]) / tokens for k in before}
                http, engine, http_process = per_token["http_loop"], per_token["engine_loop"], per_token["http_process"]
                total, client = per_token["processes"], per_token["client"]
                row = {
                    "backend": backend,
                    "concurrency": c,
                    "tokens": round(tokens),
                    "tok_s": r["output_token_throughput"],
                    "http_thread_us_per_token": http,
                    "engine_thread_us_per_token": engine,
                    "http_process_us_per_token": http_process,
                    "process_us_per_token": total,
                    "client_us_per_token": client,
                    "itl_p50_ms": r["itl"]["median_ms"],
                    "failed": r["failed"],
                }
                rows.append(row)
                print(
                    f"{backend:>7} c{c:<4} {row['tok_s']:8.0f} tok/s  http {http:6.1f} us/token  "
                    f"http process {http_process:6.1f}  engine {engine:6.1f}  process {total:6.1f}  client {client:6.1f}",
                    flush=True,
                )
                results.write(healthy_s=healthy_s, rows=rows)
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()

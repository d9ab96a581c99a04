"""The server's own host cost per streamed token: CPU seconds of the HTTP thread (the event loop:
routes, streams, server-sent events) and of the engine loop's thread, per output token, while
bench_serving drives `jspec serve` at fixed concurrency. Both threads share one interpreter and
its GIL, so what the HTTP side spends per token is time the engine loop can lose at high
concurrency. Read from /proc (Linux), on a tiny model whose device step is cheap.

    python -m benchmarks.bench_server_host [--concurrency 16,64] [--backends sglang,openai]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchmarks.common import RESULTS_DIR, Results
from benchmarks.serving_curve import get_json, start_server, stop_server
from jspec.checkpoint.tiny import make_tiny_model


def thread_cpu_s(pid: int, tid: int) -> float:
    fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def process_cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(port: int, backend: str, concurrency: int, prompts: int, input_len: int, output_len: int) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--port", str(port), "--backend", backend]
    cmd += ["--num-prompts", str(prompts), "--random-input-len", str(input_len)]
    cmd += ["--random-output-len", str(output_len), "--max-concurrency", str(concurrency), "--output-file", out]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.load(open(out))["rows"][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--backends", default="sglang,openai")
    ap.add_argument("--prompts-per-c", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--name", default="bench_server_host")
    ap.add_argument("--out", default=RESULTS_DIR)
    a = ap.parse_args()
    model = make_tiny_model(tempfile.mkdtemp() + "/tiny", max_position_embeddings=4096)
    concurrency = [int(c) for c in a.concurrency.split(",")]
    log = tempfile.mktemp(suffix=".log")
    proc, healthy_s = start_server(
        f"--model-path {model} --max-running-requests {max(concurrency)}", a.port, log, timeout=300
    )
    results = Results(a.out, a.name, vars(a))
    rows = []
    try:
        pid = proc.pid
        engine_tid = get_json(f"http://127.0.0.1:{a.port}/debug/state")["engine_thread_id"]
        for backend in a.backends.split(","):
            for c in concurrency:
                n = c * a.prompts_per_c
                drive(a.port, backend, c, c, a.input_len, a.output_len)  # compiles what this c needs
                before = thread_cpu_s(pid, pid), thread_cpu_s(pid, engine_tid), process_cpu_s(pid)
                r = drive(a.port, backend, c, n, a.input_len, a.output_len)
                after = thread_cpu_s(pid, pid), thread_cpu_s(pid, engine_tid), process_cpu_s(pid)
                tokens = r["output_token_throughput"] * r["duration_s"]
                http, engine, total = (1e6 * (y - x) / tokens for x, y in zip(before, after))
                row = {
                    "backend": backend,
                    "concurrency": c,
                    "tokens": round(tokens),
                    "tok_s": r["output_token_throughput"],
                    "http_thread_us_per_token": http,
                    "engine_thread_us_per_token": engine,
                    "process_us_per_token": total,
                    "itl_p50_ms": r["itl"]["median_ms"],
                    "failed": r["failed"],
                }
                rows.append(row)
                print(
                    f"{backend:>7} c{c:<4} {row['tok_s']:8.0f} tok/s  http {http:6.1f} us/token  "
                    f"engine {engine:6.1f}  process {total:6.1f}",
                    flush=True,
                )
                results.write(healthy_s=healthy_s, rows=rows)
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()

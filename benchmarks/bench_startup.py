"""Start-up as a user meets it: the README's main job and server, cold and warm.

Each command runs as its own process, exactly as the README gives it, with a compilation
cache directory of this benchmark's own: empty for the cold runs, filled by them for the
warm ones. For scripts/generate.py: wall time and peak resident memory. For scripts/serve.py:
seconds until /health answers, peak resident memory until then, and one chat request.

    python -m benchmarks.bench_startup [--out benchmarks/results] [--runs 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from benchmarks.common import REPO_ROOT, RESULTS_DIR, Results


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 1024


def run_generate(cache: str) -> dict:
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "scripts/generate.py", "--compilation-cache-dir", cache],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        out = log.read()
    if proc.returncode:
        raise RuntimeError(f"generate.py failed: {out[-2000:]}")
    return dict(wall_s=wall, peak_rss_mb=usage.ru_maxrss / 1024, tokens_line=out.strip().splitlines()[-1])


def machine() -> str:
    """The accelerator the servers ran on, without starting JAX in this process."""
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        if gpu.returncode == 0 and gpu.stdout.strip():
            return f"{gpu.stdout.strip().splitlines()[0]}, {os.cpu_count()} CPU cores"
    except FileNotFoundError:
        pass
    return f"{os.cpu_count()} CPU cores"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The start-up log's milestones, so that a slow start says which phase took the time.
MILESTONES = re.compile(
    r"weights loaded|compiled \d+ programs in|first step over the pool|KV pool:|mixed steps cost|warm-up:|ready:"
)
STAMP = re.compile(r"^\[jspec\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ (.*)$")


def milestones(log: str, started: float) -> list[str]:
    """The milestone lines of a server's log, each prefixed by its seconds after `started` (epoch s)."""
    out = []
    for line in log.splitlines():
        m = STAMP.match(line)
        if m and MILESTONES.search(m.group(2)):
            at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - started
            out.append(f"{at:6.1f} s  {m.group(2)[:300]}")
    return out


def run_server(cache: str, server_args: list[str], limit_s: float = 600) -> dict:
    with tempfile.TemporaryFile("w+") as log:
        started = time.time()
        row = serve_and_ask(cache, server_args, limit_s, log)
        log.seek(0)
        row["log"] = milestones(log.read(), started)
    return row


def serve_and_ask(cache: str, server_args: list[str], limit_s: float, log) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "scripts/serve.py", "--port", str(port), "--compilation-cache-dir", cache, *server_args],
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        while time.perf_counter() - t0 < limit_s and proc.poll() is None:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        healthy = time.perf_counter() - t0
        peak = peak_rss_mb(proc.pid)
        if proc.poll() is not None:
            raise RuntimeError(f"serve.py exited with {proc.returncode} before it was healthy")
        if server_args:  # a shape directory with dummy weights has no tokenizer: token ids in and out
            route, body = "/generate", {"input_ids": list(range(1, 33)), "sampling_params": {"max_new_tokens": 16}}
        else:
            route = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16}
            body["temperature"] = 0
        req = urllib.request.Request(
            url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        t1 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        answer = reply["choices"][0]["message"]["content"] if not server_args else reply["output_ids"]
        return dict(healthy_s=healthy, peak_rss_mb=peak, first_chat_s=time.perf_counter() - t1, answer=answer)
    finally:
        proc.terminate()
        proc.wait(30)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--runs", type=int, default=2, help="cold runs and warm runs of each command")
    ap.add_argument(
        "--server-args",
        default="",
        help="serve.py's arguments instead of the README's none (e.g. a shape directory with "
        "--load-format dummy); only the server runs then",
    )
    ap.add_argument("--name", default="bench_startup", help="the JSON's file name under --out")
    args = ap.parse_args()
    server_args = args.server_args.split()
    commands = [("serve.py", lambda cache: run_server(cache, server_args))]
    if not server_args:
        commands.insert(0, ("generate.py", run_generate))
    rows = []
    for what, run in commands:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as cache:
                for kind in ("cold", "warm"):
                    row = dict(command=what, cache=kind, run=i, **run(cache))
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
                    print("\n".join(row.get("log", [])), flush=True)
    settings = {
        "commands": "as the README gives them, plus a cache directory of the benchmark's own",
        "server_args": args.server_args,
        "runs": args.runs,
    }
    path = Results(args.out, args.name, settings, device=machine()).write(rows=rows)
    print(f"wrote {path}\n")
    print(f"{'command':>12} {'cache':>5} {'seconds':>8} {'peak MB':>8}")
    for r in rows:
        secs = r.get("wall_s", r.get("healthy_s"))
        print(f"{r['command']:>12} {r['cache']:>5} {secs:>8.1f} {r['peak_rss_mb']:>8.0f}")


if __name__ == "__main__":
    main()

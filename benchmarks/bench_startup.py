"""Start-up as a user meets it: the README's main job and server, cold and warm.

Each command runs as its own process, exactly as the README gives it, with a compilation
cache directory of this benchmark's own: empty for the cold runs, filled by them for the
warm ones. For scripts/generate.py: wall time and peak resident memory. For scripts/serve.py:
seconds until /health answers, peak resident memory until then, and one chat request.

    python -m benchmarks.bench_startup [--out benchmarks/results] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(cache: str, limit_s: float = 300) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "scripts/serve.py", "--port", str(port), "--compilation-cache-dir", cache],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        t1 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        return dict(healthy_s=healthy, peak_rss_mb=peak, first_chat_s=time.perf_counter() - t1, answer=answer)
    finally:
        proc.terminate()
        proc.wait(30)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--runs", type=int, default=2, help="cold runs and warm runs of each command")
    args = ap.parse_args()
    rows = []
    for what, run in (("generate.py", run_generate), ("serve.py", run_server)):
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as cache:
                for kind in ("cold", "warm"):
                    row = dict(command=what, cache=kind, run=i, **run(cache))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    settings = {
        "commands": "as the README gives them, plus a cache directory of the benchmark's own",
        "runs": args.runs,
    }
    path = Results(args.out, "bench_startup", settings, device=f"{os.cpu_count()} CPU cores").write(rows=rows)
    print(f"wrote {path}\n")
    print(f"{'command':>12} {'cache':>5} {'seconds':>8} {'peak MB':>8}")
    for r in rows:
        secs = r.get("wall_s", r.get("healthy_s"))
        print(f"{r['command']:>12} {r['cache']:>5} {secs:>8.1f} {r['peak_rss_mb']:>8.0f}")


if __name__ == "__main__":
    main()

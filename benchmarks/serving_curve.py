"""The serving curve: a server started with each flag set, driven by bench_serving at rising
concurrency, output tok/s and latency against concurrency, the flag sets side by side.

    python -m benchmarks.serving_curve --server-args "--model-path benchmarks/shapes/llama-3.1-8b --load-format dummy" \\
        --variant default= --variant eagle3="--speculative-algorithm EAGLE3 ..." --concurrency 1,16,64,128,256

--prompts heldout sends jspec.train.prompts' held-out prompts instead (a real model's: rendered
with its chat template, answers ending at EOS, up to --output-len), the workload on which the
speculative methods' acceptance means something; their curve is labelled input length 0.

A variant's leading NAME=value words set its server's environment (`--variant
vmm="XLA_PYTHON_CLIENT_ALLOCATOR=vmm --flag"`), for runtime settings read only at start-up.

Each variant's server starts once (its time to healthy is recorded, cold or warm as the
compilation cache is), then for each prompt length and concurrency c: max(min_prompts, c x
prompts_per_c) random prompts, all sent at once, at most c in flight, greedy, ignore_eos,
through bench_serving's client (aiohttp where installed: httpx's per-chunk cost saturated a core
near 10,000 chunks a second). The
server's own loop split (host schedule / launch / process against the wait on the device, per
iteration) is read from /debug/state around each run. One JSON (benchmarks/results/NAME.json)
and a PNG plot beside it: per prompt length, output tok/s and ITL p50 / p99 against c.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import types
import urllib.request

from benchmarks.bench_serving import random_requests, run
from benchmarks.common import Results, pyplot, run_label, save_png
from jspec.engine.engine import TOKEN_GAP_BIN_MS

LOOP_KEYS = (
    "iterations",
    "prefill_steps",
    "mixed_steps",
    "decode_steps",
    "schedule_s",
    "launch_s",
    "wait_s",
    "process_s",
    "running_sum",
    "waiting_sum",
)


def stat_cpu_s(path: str) -> float:
    """CPU seconds (user + system) in a /proc stat file (Linux)."""
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int, tid: int) -> float:
    return stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")


def process_cpu_s(pid: int) -> float:
    """All of the process's threads."""
    return stat_cpu_s(f"/proc/{pid}/stat")


def cpu_clocks(server_pid: int, state: dict) -> dict:
    """The CPU seconds so far of the HTTP process's event loop (its main thread) and of the whole
    HTTP process, of the engine loop's thread, and of this process (bench_serving's client)."""
    engine_pid, engine_tid = state["engine_pid"], state["engine_thread_id"]
    return {
        "http_loop": thread_cpu_s(server_pid, server_pid),
        "http_process": process_cpu_s(server_pid),
        "engine_loop": thread_cpu_s(engine_pid, engine_tid),
        "client": sum(os.times()[:2]),
        "wall": time.perf_counter(),
    }


def cpu_busy(before: dict, after: dict) -> dict:
    """Each clock's CPU seconds per second of the run: 1.0 is a core kept busy. An HTTP loop
    near 1.0 while the engine's batch runs short of the concurrency is a frontend that sets the
    pace."""
    wall = max(after["wall"] - before["wall"], 1e-9)
    return {k: round((after[k] - before[k]) / wall, 3) for k in before if k != "wall"}


def get_json(url: str, timeout: float = 10):
    return json.loads(urllib.request.urlopen(url, timeout=timeout).read())


def split_env(flags: str) -> tuple[dict[str, str], str]:
    """A variant's leading NAME=value words (as a shell reads them: quote a value with spaces)
    are its server's environment, the rest its flags: a runtime setting read only at start-up
    (an allocator, XLA_FLAGS) is a variant like any flag."""
    words, env = shlex.split(flags), {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0], re.DOTALL):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, shlex.join(words)


def start_server(
    args_line: str, port: int, log_path: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, float]:
    """Starts `jspec serve` with these flags (and environment variables beside the inherited
    ones); returns it and its seconds to healthy."""
    cmd = [sys.executable, "-m", "jspec", "serve", "--port", str(port), *shlex.split(args_line)]
    print("$", " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), shlex.join(cmd), flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
    )
    _stop_on_sigterm(proc)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy (log: {log_path})")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, time.perf_counter() - t0
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s (log: {log_path})")


def _stop_on_sigterm(proc: subprocess.Popen) -> None:
    """A run stopped from outside (a step's time limit) takes its server down with it: the server
    runs in a session of its own, and one left running holds the GPU the next run needs."""

    def stop(signum, frame):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def loop_split(before: dict, after: dict) -> dict:
    """The server's loop over one run: iterations, and host / wait milliseconds per iteration."""
    d = {k: after[k] - before[k] for k in LOOP_KEYS}
    n = max(d["iterations"], 1)
    host = d["schedule_s"] + d["launch_s"] + d["process_s"]
    return {
        "iterations": d["iterations"],
        "prefill_steps": d["prefill_steps"],
        "mixed_steps": d["mixed_steps"],
        "decode_steps": d["decode_steps"],
        **{f"{k[:-2]}_ms": 1e3 * d[k] / n for k in ("schedule_s", "launch_s", "process_s", "wait_s")},
        "host_ms": 1e3 * host / n,
        "running_per_iteration": d["running_sum"] / n,
        "waiting_per_iteration": d["waiting_sum"] / n,
        "token_gaps": token_gap_split(before.get("token_gaps"), after.get("token_gaps")),
    }


def histogram_percentile(counts: list[int], q: float) -> float | None:
    """The q-th percentile of a TOKEN_GAP_BIN_MS histogram, as its bin's upper edge (ms)."""
    seen = list(itertools.accumulate(counts))
    if not seen or seen[-1] == 0:
        return None
    return (bisect.bisect_left(seen, q / 100 * seen[-1]) + 1) * TOKEN_GAP_BIN_MS


def token_gap_split(before: dict | None, after: dict | None) -> dict | None:
    """The engine's own inter-token gaps over one run (LoopTimes.token_gaps): count, p50 and p99
    (ms) over all steps and by the kind of step that gave the later tokens, to set beside the
    client's ITL (the difference is the stream's path from the loop to the client)."""
    if before is None or after is None:
        return None
    kinds = {k: [a - b for a, b in zip(after[k], before[k])] for k in after}
    kinds["all"] = [sum(col) for col in zip(*kinds.values())]
    return {
        k: {"count": sum(c), "p50_ms": histogram_percentile(c, 50), "p99_ms": histogram_percentile(c, 99)}
        for k, c in kinds.items()
    }


def gc_split(before: dict | None, after: dict | None) -> dict | None:
    """Python's collections in the engine's process over one run: count and milliseconds per
    generation (the longest is since start: a run's own longest is not kept)."""
    if before is None or after is None:
        return None
    return {
        "count": [a - b for a, b in zip(after["count"], before["count"])],
        "total_ms": [round(a - b, 3) for a, b in zip(after["total_ms"], before["total_ms"])],
        "max_ms_since_start": after["max_ms"],
    }


def measure_variant(name: str, flags: str, a, port: int, out_dir: str) -> dict:
    log = os.path.join(out_dir, f"{a.name}_{name}.log")
    env, flags = split_env(flags)
    proc, healthy_s = start_server(f"{a.server_args} {flags}", port, log, a.timeout, env)
    url = f"http://127.0.0.1:{port}"
    rows, info = [], None
    try:
        info = get_json(url + "/get_server_info")
        vocab = get_json(url + "/v1/models")["data"][0].get("vocab_size", 32000)
        print(f"[{name}] healthy in {healthy_s:.1f} s: {json.dumps(info)}", flush=True)
        client = types.SimpleNamespace(
            base_url=url, backend="sglang", model=None, dataset_name="random", max_concurrency=None, seed=0
        )
        client.dataset_name = a.prompts  # bench_serving ignores EOS on random prompts only
        for input_len in a.input_lens if a.prompts == "random" else [0]:
            for c in a.concurrency:
                n = max(a.min_prompts, c * a.prompts_per_c)
                if a.prompts == "random":
                    requests = random_requests(n, input_len, a.output_len, 1.0, vocab, seed=c)
                else:
                    requests = [(ids, a.output_len) for ids in heldout_prompt_ids(a.server_args, n)]
                client.max_concurrency = c
                state = get_json(url + "/debug/state")
                before, clocks, gc_before = state["loop"], cpu_clocks(proc.pid, state), state.get("gc")
                try:
                    row = asyncio.run(asyncio.wait_for(run(client, requests, float("inf")), a.run_timeout))
                except TimeoutError as e:
                    state = get_json(url + "/debug/state")
                    raise RuntimeError(
                        f"c={c}: not done in {a.run_timeout:.0f} s; server state {state} (log: {log})"
                    ) from e
                state = get_json(url + "/debug/state")
                row.update(variant=name, input_len=input_len, output_len=a.output_len, concurrency=c, num_prompts=n)
                row["loop"] = loop_split(before, state["loop"])
                row["gc"] = gc_split(gc_before, state.get("gc"))
                row["cpu_busy"] = cpu_busy(clocks, cpu_clocks(proc.pid, state))
                rows.append(row)
                print(summary_line(row), flush=True)
    finally:
        stop_server(proc)
    return {"name": name, "flags": flags, "healthy_s": healthy_s, "server": info, "rows": rows}


def heldout_prompt_ids(server_args: str, n: int) -> list[list[int]]:
    """n of jspec's held-out prompts (cycled), as the served model's chat template renders them."""
    from jspec.checkpoint.tokenizer import load_tokenizer
    from jspec.server.chat_template import render_chat
    from jspec.train.prompts import split_prompts

    argv = shlex.split(server_args)
    path = argv[argv.index("--model-path") + 1]
    tok = load_tokenizer(path)
    _, held = split_prompts(0, min(n, 64))
    ids = [tok.encode(render_chat(tok, [{"role": "user", "content": p}]), add_special_tokens=False) for p in held]
    return [ids[i % len(ids)] for i in range(n)]


def summary_line(r: dict) -> str:
    def ms(d, k):
        return f"{d[k]:.1f}" if d[k] is not None else "-"

    lp = r["loop"]
    return (
        f"{r['variant']:>12} in={r['input_len']:<5} c={r['concurrency']:<4} ok={r['completed']:<4} "
        f"tok/s={r['output_token_throughput']:>8.0f}  TTFT p50/p99={ms(r['ttft'], 'median_ms')}/{ms(r['ttft'], 'p99_ms')}  "
        f"ITL p50/p99={ms(r['itl'], 'median_ms')}/{ms(r['itl'], 'p99_ms')}  "
        f"loop: {lp['iterations']} it ({lp['prefill_steps']} prefill, {lp['mixed_steps']} mixed), host {lp['host_ms']:.2f} ms "
        f"(launch {lp['launch_ms']:.2f}, process {lp['process_ms']:.2f}), wait {lp['wait_ms']:.2f} ms, "
        f"running {lp['running_per_iteration']:.0f} / waiting {lp['waiting_per_iteration']:.0f} per iteration"
        + (
            f"; CPU busy: HTTP loop {cpu['http_loop']:.2f}, engine loop {cpu['engine_loop']:.2f}, client {cpu['client']:.2f}"
            if (cpu := r.get("cpu_busy"))
            else ""
        )
        + (
            f"; engine gaps p50/p99 {g['all']['p50_ms']}/{g['all']['p99_ms']} ms"
            + (f" (mixed steps' {g['mixed']['p99_ms']} ms, {g['mixed']['count']} gaps)" if g["mixed"]["count"] else "")
            if (g := lp.get("token_gaps")) and g["all"]["count"]
            else ""
        )
        + (f"  accept {r['mean_accept_length']:.2f}" if r.get("mean_accept_length") else "")
        + (
            f"; gc {'/'.join(map(str, g['count']))} collections, {sum(g['total_ms']):.1f} ms"
            if (g := r.get("gc"))
            else ""
        )
    )


def plot(path_json: str) -> str | None:
    """The PNG beside the JSON: a row of panels per prompt length (tok/s, ITL p50 and p99)."""
    plt = pyplot("serving_curve")
    if plt is None:
        return None
    with open(path_json) as f:
        data = json.load(f)
    lens = sorted({r["input_len"] for v in data["variants"] for r in v["rows"]})
    fig, axes = plt.subplots(len(lens), 2, figsize=(11, 3.6 * len(lens)), squeeze=False)
    for i, n in enumerate(lens):
        tput, lat = axes[i]
        for v in data["variants"]:
            rows = sorted((r for r in v["rows"] if r["input_len"] == n), key=lambda r: r["concurrency"])
            cs = [r["concurrency"] for r in rows]
            (line,) = tput.plot(cs, [r["output_token_throughput"] for r in rows], "o-", label=v["name"])
            lat.plot(cs, [r["itl"]["median_ms"] for r in rows], "o-", color=line.get_color(), label=f"{v['name']} p50")
            lat.plot(cs, [r["itl"]["p99_ms"] for r in rows], "x--", color=line.get_color(), label=f"{v['name']} p99")
        for ax, ylabel in ((tput, "output tok/s"), (lat, "ITL ms")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        tput.set_title(f"{n} prompt tokens, {data['settings']['output_len']} output tokens")
    fig.suptitle(f"{data['settings']['server_args']} {run_label(data)}", fontsize=8)
    return save_png(fig, path_json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-args", default="", help="flags every variant's server gets")
    ap.add_argument(
        "--variant",
        action="append",
        metavar="NAME=FLAGS",
        help="a flag set added to --server-args, side by side with the others (default: default=, no extra flags)",
    )
    ap.add_argument("--concurrency", default="1,16,64,128,256")
    ap.add_argument("--input-lens", default="128,1024", help="prompt lengths, one curve each")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompts", choices=("random", "heldout"), default="random", help="the workload (see above)")
    ap.add_argument("--prompts-per-c", type=int, default=2, help="prompts sent per unit of concurrency")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--timeout", type=float, default=600, help="seconds a server may take to get healthy")
    ap.add_argument("--run-timeout", type=float, default=180, help="seconds one concurrency's run may take")
    ap.add_argument("--name", default="serving_curve")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run's JSON")
    a = ap.parse_args()
    if a.plot:
        print(plot(a.plot))
        return
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.input_lens = [int(n) for n in a.input_lens.split(",")]
    variants = [v.split("=", 1) for v in (a.variant or ["default="])]
    os.makedirs(a.out, exist_ok=True)
    settings = {
        k: getattr(a, k) for k in ("server_args", "concurrency", "input_lens", "output_len", "prompts_per_c", "prompts")
    }
    settings["min_prompts"], settings["variants"] = a.min_prompts, dict(variants)
    results, done = None, []
    for name, flags in variants:
        try:
            done.append(measure_variant(name, flags, a, a.port, a.out))
        except RuntimeError as e:
            print(f"[{name}] {e}", flush=True)
            done.append({"name": name, "flags": flags, "error": str(e), "rows": []})
        # The device and jax version are the server's: this process starts no backend (on a GPU it
        # would take the server's memory).
        server = next((v["server"] for v in done if v.get("server")), None)
        results = results or (Results(a.out, a.name, settings, server=server) if server else None)
        if results is not None:  # after each variant, so a cut run keeps what it measured
            path = results.write(variants=done)
    if results is None:
        raise SystemExit("no server got healthy: nothing measured")
    print(f"\nwrote {path}; plot: {plot(path)}")
    for v in done:
        print(f"{v['name']}: healthy in {v.get('healthy_s', float('nan')):.1f} s")
        for r in v["rows"]:
            print(summary_line(r))


if __name__ == "__main__":
    main()

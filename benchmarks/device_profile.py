"""Where a jitted step's device time goes: a jax.profiler trace of a few back-to-back calls,
summarised per GPU kernel (benchmarks use it to split a step's gap to its floor).

    from benchmarks.device_profile import profile_calls
    summary = profile_calls(step, calls=5)   # step() launches one call and returns its outputs

The trace's device events are the kernels each call ran, in stream order. Per call:
- busy_us: the sum of kernel durations (what the kernels themselves cost);
- span_us: first kernel start to last kernel end, over the calls (busy + the gaps between
  kernels, i.e. launch latency the GPU waited through);
- kernels: how many kernels one call runs;
- by_kind: busy time by a coarse kind read off the kernel name (GEMM/GEMV, the Pallas
  attention kernels, other XLA fusions, copies), and top: the largest kernels by total time.
The kinds are a reading aid: the names are XLA's and Triton's, and `top` lists them raw.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable

import jax

# First match wins; matched against the lower-cased kernel name.
KINDS = (
    ("attention (Pallas)", re.compile(r"paged_|attention|flash")),
    ("skinny matmul (Pallas)", re.compile(r"skinny")),
    ("add + RMSNorm (Pallas)", re.compile(r"add_rms_norm")),
    ("matmul (cuBLAS / XLA gemm)", re.compile(r"gemm|gemv|cublas|cutlass|xmma|sm90|dot|matmul|nvjet")),
    ("copy / memset", re.compile(r"memcpy|memset|copy")),
    ("reduction fusion", re.compile(r"reduce|reduction")),
    ("other fusion", re.compile(r"fusion|loop_|input_|triton|scatter|gather|concatenate|dynamic")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if pattern.search(low):
            return kind
    return "other"


def _device_kernel_events(trace: dict) -> list[dict]:
    """Complete events ('X') on the GPU's stream threads, sorted by start."""
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu_pids = {pid for pid, n in names.items() if "/device:GPU" in n}
    threads = {
        (e["pid"], e["tid"]): e.get("args", {}).get("name", "")
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] in gpu_pids and e.get("dur")]
    # Streams carry kernels and memcpys; the device pid also has per-op summary lines (XLA Ops,
    # XLA Modules) that repeat the same time: keep the stream threads only.
    stream = [e for e in evs if "stream" in threads.get((e["pid"], e["tid"]), "").lower()]
    return sorted(stream or evs, key=lambda e: e["ts"])


def summarise(events: list[dict], calls: int) -> dict:
    if not events:
        return {"error": "no device kernel events in the trace (is this a GPU?)"}
    busy = sum(e["dur"] for e in events)
    span = max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        per_name[e["name"]].append(e["dur"])
    by_kind: dict[str, float] = collections.Counter()
    count_kind: dict[str, int] = collections.Counter()
    for name, durs in per_name.items():
        by_kind[kind_of(name)] += sum(durs) / calls
        count_kind[kind_of(name)] += len(durs) // calls
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "calls": calls,
        "kernels": len(events) // calls,
        "busy_us": busy / calls,
        "span_us": span / calls,
        "gaps_us": (span - busy) / calls,
        "by_kind": {
            k: {"us": round(v, 2), "kernels": count_kind[k]} for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top": [
            {
                "name": n[:160],
                "kind": kind_of(n),
                "us_per_call": round(sum(d) / calls, 2),
                "count_per_call": len(d) / calls,
                "mean_us": round(sum(d) / len(d), 2),
            }
            for n, d in top
        ],
    }


def host_self_times(trace: dict, calls: int, top: int = 25) -> dict:
    """The host's side of a trace: each TraceMe name's self time (its duration less that of the
    events nested in it on the same thread) and count, per call, largest first. XLA's runtime
    names its work (the executable's launch, each thunk, command-buffer updates), so this says
    where a launch's host time goes below the Python call."""
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    host_pids = {pid for pid, n in names.items() if "/host:" in n}
    by_thread: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        # The profiler's own start and stop are in the trace too: not the traced work.
        if e.get("ph") == "X" and e["pid"] in host_pids and e.get("dur") is not None and "profiler" not in e["name"]:
            by_thread[(e["pid"], e["tid"])].append(e)
    self_us: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_events: list[tuple[float, str]] = []  # (end, name) of the events enclosing this one
        for e in evs:
            while open_events and e["ts"] >= open_events[-1][0]:
                open_events.pop()
            if open_events:  # nested: its time is not its parent's own
                self_us[open_events[-1][1]] -= e["dur"]
            self_us[e["name"]] += e["dur"]
            count[e["name"]] += 1
            open_events.append((e["ts"] + e["dur"], e["name"]))
    rows = sorted(self_us.items(), key=lambda kv: -kv[1])[:top]
    return {
        "calls": calls,
        "self_us_per_call": {n[:160]: round(t / calls, 2) for n, t in rows},
        "count_per_call": {n[:160]: count[n] / calls for n, _ in rows},
    }


def trace_calls(step: Callable[[], object], calls: int = 5, log_dir: str | None = None) -> dict | None:
    """The profiler's trace (parsed JSON) of `calls` back-to-back calls of step(), already
    compiled and warm; None if no trace was written. Python's own functions are not traced
    (JAX's default traces them): that tracer slows the host, which would stretch the launch
    gaps and the host times read here."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="jspec_profile_")
    jax.block_until_ready(step())
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(log_dir, profiler_options=options)
    try:
        out = None
        for _ in range(calls):
            out = step()
        jax.block_until_ready(out)
    finally:
        jax.profiler.stop_trace()
    files = sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz")), key=os.path.getmtime)
    if not files:
        return None
    with gzip.open(files[-1], "rb") as f:
        return json.load(f)


def profile_calls(step: Callable[[], object], calls: int = 5, log_dir: str | None = None) -> dict:
    """Traces `calls` back-to-back calls of step() (already compiled and warm) and summarises
    the device kernels per call."""
    trace = trace_calls(step, calls, log_dir)
    if trace is None:
        return {"error": "no trace written"}
    return device_summary(trace, calls)


def device_summary(trace: dict, calls: int) -> dict:
    """summarise() over a trace's device kernels."""
    return summarise(_device_kernel_events(trace), calls)


def print_summary(title: str, s: dict) -> None:
    if "error" in s:
        print(f"{title}: {s['error']}")
        return
    print(
        f"{title}: {s['kernels']} kernels, busy {s['busy_us']:.0f} us, span {s['span_us']:.0f} us, "
        f"gaps {s['gaps_us']:.0f} us per call"
    )
    for kind, v in s["by_kind"].items():
        print(f"  {kind:<28} {v['us']:>9.1f} us  {v['kernels']:>5} kernels")
    for t in s["top"][:8]:
        print(f"  {t['us_per_call']:>9.1f} us  x{t['count_per_call']:<5g} {t['name'][:90]}")

"""The five performance targets from one run: the kernel, decode-step and host-time benchmarks,
each in its own process (fresh device memory) one after the other, and one JSON that holds
their whole records and a verdict per target. One device call:

    python -m benchmarks.bench_roofline [--out benchmarks/results] [--skip kernels,decode,overlap]
    python -m benchmarks.bench_roofline --tiny      # a CPU dry run of the script itself

Targets (H200, Llama-3.1-8B shape):
  1. paged decode attention, B=32, ctx 4096, page 16: >= 75% of the copy bandwidth; page
     sizes 1 and 64 within 15% of page 16
  2. tree-masked verify attention, B=32 x 8 tokens, ctx 4096: >= 60% of the copy bandwidth
  3. decode step at bs=1 <= 1.15x its bandwidth floor; bs=64 reported against both floors
  4. a target forward over 8 verify tokens at bs=1 <= 1.1x a decode forward
  5. host time per iteration below the device time at bs=1 on the 8B shape; the small
     model's reported
A target whose benchmark did not run, or whose case failed, reads "not run".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO_ROOT, RESULTS_DIR, Results

DECODE_FRACTION, PAGE_SPREAD, TREE_FRACTION, STEP_RATIO, VERIFY_RATIO = 0.75, 1.15, 0.60, 1.15, 1.1


def _default(case: dict | None) -> dict | None:
    """A kernel case's default-tuned jspec result, if it ran and matched the reference."""
    for r in (case or {}).get("results", []):
        if r.get("variant") == "default" and r.get("ok") and "median_us" in r:
            return r
    return None


def _row(target: str, figure: str, threshold: str, met: bool | None, note: str = "") -> dict:
    return dict(target=target, figure=figure, threshold=threshold, met=met, note=note)


def _not_run(target: str, threshold: str, why: str) -> dict:
    return _row(target, "not run", threshold, None, why)


def evaluate(kernels: dict | None, decode: dict | None, overlap: dict | None) -> list[dict]:
    """One row per (sub-)target: the measured figure, the threshold, met (True / False, or
    None where a target asks only for a report)."""
    rows = []
    cases = {c["name"]: c for c in (kernels or {}).get("cases", [])}

    s16 = _default(cases.get("decode_b32_ctx4096_s16"))
    thr = f">= {DECODE_FRACTION:.0%} of copy bandwidth"
    if s16:
        bundled = next(
            (
                r
                for r in cases["decode_b32_ctx4096_s16"]["results"]
                if r.get("kernel") == "jax_bundled" and "achieved_tbps" in r
            ),
            None,
        )
        note = f"JAX bundled kernel {bundled['achieved_tbps']:.2f} TB/s" if bundled else ""
        rows.append(
            _row(
                "1 decode attention B=32 ctx 4096 page 16",
                f"{s16['achieved_tbps']:.2f} TB/s ({s16['fraction_of_copy_bw']:.0%} of copy)",
                thr,
                s16["fraction_of_copy_bw"] >= DECODE_FRACTION,
                note,
            )
        )
        for page in (1, 64):
            other = _default(cases.get(f"decode_b32_ctx4096_s{page}"))
            name, t = f"1 decode attention page {page} vs page 16", f"<= {PAGE_SPREAD:.2f}x"
            if other:
                ratio = other["median_us"] / s16["median_us"]
                rows.append(
                    _row(
                        name,
                        f"{ratio:.3f}x ({other['median_us']:.1f} vs {s16['median_us']:.1f} us)",
                        t,
                        ratio <= PAGE_SPREAD,
                    )
                )
            else:
                rows.append(_not_run(name, t, "case missing or failed"))
    else:
        rows.append(_not_run("1 decode attention B=32 ctx 4096 page 16", thr, "case missing or failed"))

    tree = _default(cases.get("tree_b32_q8_ctx4096_s16"))
    thr = f">= {TREE_FRACTION:.0%} of copy bandwidth"
    name = "2 tree verify attention B=32 x 8 ctx 4096"
    rows.append(
        _row(
            name,
            f"{tree['achieved_tbps']:.2f} TB/s ({tree['fraction_of_copy_bw']:.0%} of copy)",
            thr,
            tree["fraction_of_copy_bw"] >= TREE_FRACTION,
        )
        if tree
        else _not_run(name, thr, "case missing or failed")
    )

    steps = sorted((decode or {}).get("rows", []), key=lambda r: (r["batch"], r["context"]))
    steps = [r for r in steps if r.get("layout", "per_layer") == "per_layer"]
    if steps:
        low, high = steps[0], max(steps, key=lambda r: r["batch"])
        rows.append(
            _row(
                f"3 decode step bs={low['batch']} ctx {low['context']}",
                f"{low['step_ms']:.3f} ms = {low['x_bandwidth_floor']:.2f}x the "
                f"{low['bandwidth_floor_ms']:.3f} ms bandwidth floor",
                f"<= {STEP_RATIO:.2f}x",
                low["x_bandwidth_floor"] <= STEP_RATIO,
            )
        )
        if high is not low:
            rows.append(
                _row(
                    f"3 decode step bs={high['batch']} ctx {high['context']}",
                    f"{high['step_ms']:.3f} ms = {high['x_bandwidth_floor']:.2f}x bandwidth floor, "
                    f"{high['step_ms'] / high['matmul_floor_ms']:.1f}x matmul floor",
                    "report",
                    None,
                )
            )
        if "verify_over_decode" in low:
            rows.append(
                _row(
                    f"4 verify {low['verify_tokens']} tokens vs decode, bs={low['batch']}",
                    f"{low['verify_over_decode']:.3f}x ({low['forward_verify_ms']:.3f} vs "
                    f"{low['forward_decode_ms']:.3f} ms)",
                    f"<= {VERIFY_RATIO}x",
                    low["verify_over_decode"] <= VERIFY_RATIO,
                )
            )
        else:
            rows.append(_not_run("4 verify vs decode", f"<= {VERIFY_RATIO}x", "--verify-tokens 0"))
    else:
        rows.append(_not_run("3 decode step", f"<= {STEP_RATIO:.2f}x", "bench_decode did not run"))
        rows.append(_not_run("4 verify vs decode", f"<= {VERIFY_RATIO}x", "bench_decode did not run"))

    host_rows = [r for r in (overlap or {}).get("rows", []) if r["batch"] == 1]
    for r in host_rows:
        host, dev = r["overlap_host_ms"]["host"], r["device_step_ms"]
        graded = r["model"] == "8b"  # the target is graded on the 8B shape; the others are reported
        rows.append(
            _row(
                f"5 host per iteration, {r['model']} {r['method']} bs=1",
                f"host {host:.3f} ms vs device {dev:.3f} ms (launch {r['overlap_host_ms']['launch']:.3f})",
                "host < device" if graded else "report",
                host < dev if graded else None,
            )
        )
    if not host_rows:
        rows.append(_not_run("5 host per iteration", "host < device", "bench_overlap did not run"))
    return rows


def run_part(name: str, argv: list[str], record_name: str, out: str, timeout: int) -> tuple[dict | None, dict]:
    """Runs one benchmark module (argv[0], under benchmarks/) into `out`; (its JSON `record_name`
    or None, what happened)."""
    t = time.perf_counter()
    try:
        # A failing part is recorded (rc, output tail), not fatal: the other targets still get graded.
        done = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{argv[0]}", *argv[1:], "--out", out],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
            check=False,
        )
        rc, tail = done.returncode, (done.stdout + done.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        partial = e.stdout or b""  # bytes even with text=True
        rc, tail = "timeout", (partial.decode(errors="replace") if isinstance(partial, bytes) else partial)[-1500:]
    info = {"command": "python -m benchmarks." + " ".join(argv), "rc": rc, "wall_s": round(time.perf_counter() - t, 1)}
    print(f"[roofline] {name}: rc {rc} in {info['wall_s']} s", flush=True)
    if rc != 0:
        info["output_tail"] = tail
        print(tail, flush=True)
    path = os.path.join(out, record_name + ".json")
    # A part cut short still leaves the rows it finished (each script writes after every row).
    record = None
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
    return record, info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--name", default="bench_roofline")
    ap.add_argument("--skip", default="", help="comma-separated parts not to run: kernels, decode, overlap")
    ap.add_argument("--part-timeout", type=int, default=300, help="seconds per part")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and models: a CPU dry run of the script")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    t = ["--tiny"] if args.tiny else []
    parts = {  # name: (command, the JSON it writes under --out)
        "kernels": (["bench_kernels", "--quick"] + (["--smoke"] if args.tiny else []), "bench_kernels"),
        "decode": (
            ["bench_decode", "--quick", "--no-stacked", "--profile"]
            + t
            + ([] if args.tiny else ["--batches", "1,64", "--contexts", "1024"]),
            "bench_decode",
        ),
        "overlap": (
            ["bench_overlap", "--name", "bench_overlap_host"]
            + t
            + ["--batches", "1"]
            + ([] if args.tiny else ["--models", "small,8b"]),
            "bench_overlap_host",
        ),
    }
    records, runs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (command, record_name) in parts.items():
            if name in skip:
                records[name], runs[name] = None, {"skipped": True}
                continue
            records[name], runs[name] = run_part(name, command, record_name, tmp, args.part_timeout)
    targets = evaluate(records["kernels"], records["decode"], records["overlap"])
    settings = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "tiny": args.tiny,
        "skip": sorted(skip),
        "part_timeout_s": args.part_timeout,
    }
    path = Results(args.out, args.name, settings).write(targets=targets, runs=runs, records=records)
    print(f"\nwrote {path}\n")
    verdict = {True: "met", False: "NOT met", None: "-"}
    for r in targets:
        print(f"{r['target']:46s} {r['figure']:58s} {r['threshold']:30s} {verdict[r['met']]}")


if __name__ == "__main__":
    main()

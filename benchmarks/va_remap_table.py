"""The command-buffer address settings side by side (gpu_session.sh launch_va_remap).

Reads, from one results folder, each setting's bench_host_launch_va_<setting>.json (SmolLM2's
bs-1 launch) and va_<setting>/bench_call_cost_moving.json (the add-and-norm chain with an
operand at a new address every call), and writes bench_va_remap.json: per setting the idle and
in-loop launch, the chain's host cost a call per backend, and whether its generated tokens
equal the default setting's (a setting that changes the output is wrong, however fast).

    python -m benchmarks.va_remap_table RESULTS_DIR
"""

from __future__ import annotations

import argparse
import glob
import json
import os

from benchmarks.common import Results


def read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def setting_rows(folder: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "bench_host_launch_va_*.json"))):
        setting = os.path.basename(path)[len("bench_host_launch_va_") : -len(".json")]
        launch = read(path)
        chain = read(os.path.join(folder, f"va_{setting}", "bench_call_cost_moving.json"))
        row: dict = {"setting": setting}
        if launch:
            r = launch["rows"][0]
            row |= dict(
                xla_flags=launch["settings"].get("xla_flags", ""),
                allocator=launch["settings"].get("allocator", "default"),
                idle_launch_ms=r["idle"]["launch_ms"],
                idle_launch_outputs_kept_ms=r["idle"]["launch_outputs_kept_ms"],
                loop_launch_ms=r["overlap_loop_ms"]["launch"],
                loop_wait_ms=r["overlap_loop_ms"]["wait"],
                generated_tokens=r.get("generated_tokens"),
            )
        if chain:
            row["moving_chain_host_us_per_call"] = {b["backend"]: b["host_us_per_call"] for b in chain["backends"]}
        rows.append(row)
    base = next((r.get("generated_tokens") for r in rows if r["setting"] == "default"), None)
    for r in rows:
        tokens = r.pop("generated_tokens", None)
        r["same_tokens_as_default"] = None if base is None or tokens is None else tokens == base
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--out", help="where bench_va_remap.json goes (default: the folder)")
    args = ap.parse_args()
    rows = setting_rows(args.folder)
    if not rows:
        raise SystemExit(f"no bench_host_launch_va_*.json in {args.folder}")
    path = Results(args.out or args.folder, "bench_va_remap", {"model": "smollm2-135m shape", "batch": 1}).write(
        rows=rows
    )
    print(f"wrote {path}\n")
    print(
        f"{'setting':>20} {'idle launch':>11} {'kept':>6} {'loop launch':>11} {'wait':>6}  chain us/call  same tokens"
    )
    for r in rows:
        chain = " ".join(f"{b} {us:.2f}" for b, us in r.get("moving_chain_host_us_per_call", {}).items()) or "-"
        if "idle_launch_ms" not in r:
            print(f"{r['setting']:>20} {'(no launch figures)':>37}  {chain}")
            continue
        print(
            f"{r['setting']:>20} {r['idle_launch_ms']:>11.3f} {r['idle_launch_outputs_kept_ms']:>6.3f} "
            f"{r['loop_launch_ms']:>11.3f} {r['loop_wait_ms']:>6.3f}  {chain}  {r['same_tokens_as_default']}"
        )


if __name__ == "__main__":
    main()

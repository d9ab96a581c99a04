"""The GPU benchmark scripts' CPU dry runs (--tiny): a script that breaks here would waste
a GPU session. Figures on the CPU mean nothing; these check that every row is produced and
carries the fields benchmarks/NOTES.md reads."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str) -> None:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), "--tiny", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_bench_decode_times_verify_against_decode(tmp_path):
    run_script("bench_decode.py", "--no-stacked", "--out", str(tmp_path))
    rows = [r for r in json.load(open(tmp_path / "bench_decode.json"))["rows"] if r["layout"] == "per_layer"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["step_ms"] > 0 and r["verify_tokens"] == 8
        assert r["forward_verify_ms"] > 0 and r["forward_decode_ms"] > 0
        assert r["verify_over_decode"] == r["forward_verify_ms"] / r["forward_decode_ms"]


def test_bench_lora_rows_and_kernel_counts(tmp_path):
    run_script("bench_lora.py", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "bench_lora.json"))["rows"]
    assert [(r["lora_pool"], r["distinct_adapters"]) for r in rows] == [(False, 0), (True, 0), (True, 1), (True, 4)]
    assert rows[0]["overhead_vs_no_pool"] == 0.0
    # The pool's step has more kernels than the one without it (its A matmuls, masks).
    assert rows[1]["step_kernels"] > rows[0]["step_kernels"] > 0
    assert all(r["device_step_ms"] > 0 and r["loop_step_ms"] > 0 for r in rows)

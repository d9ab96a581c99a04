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


def test_device_profile_splits_busy_time_and_gaps_per_call():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from device_profile import _device_kernel_events, summarise

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}}]
    kernels = []
    for call in range(2):  # each call: a gemv (10 us), a gap of 2 us, the attention kernel (4 us)
        t0 = call * 20.0
        kernels += [{"ph": "X", "pid": 1, "tid": 7, "ts": t0, "dur": 10.0, "name": "gemv_fusion"},
                    {"ph": "X", "pid": 1, "tid": 7, "ts": t0 + 12, "dur": 4.0, "name": "paged_decode_s16_g4_n64"},
                    {"ph": "X", "pid": 1, "tid": 9, "ts": t0, "dur": 16.0, "name": "fusion.1"},  # op summary: ignored
                    {"ph": "X", "pid": 2, "tid": 3, "ts": t0, "dur": 50.0, "name": "PjitFunction(step)"}]
    s = summarise(_device_kernel_events({"traceEvents": meta + kernels}), calls=2)
    assert s["kernels"] == 2 and s["busy_us"] == 14.0
    assert s["span_us"] == (20 + 16) / 2 and s["gaps_us"] == s["span_us"] - 14.0
    assert s["by_kind"]["matmul (cuBLAS / XLA gemm)"] == {"us": 10.0, "kernels": 1}
    assert s["by_kind"]["attention (Pallas)"] == {"us": 4.0, "kernels": 1}
    assert [t["name"] for t in s["top"]] == ["gemv_fusion", "paged_decode_s16_g4_n64"]

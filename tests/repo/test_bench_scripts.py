"""The GPU benchmarks' CPU dry runs (--tiny): a benchmark that breaks here would waste a GPU
session. Figures on the CPU mean nothing; these check that every row is produced and carries
the fields benchmarks/NOTES.md reads."""

import json
import subprocess
import sys

import pytest
from support import REPO_ROOT

pytestmark = pytest.mark.slow  # runs the benchmark scripts, which build engines

ROOT = REPO_ROOT


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def run_script(name: str, *args: str) -> None:
    run_module(f"benchmarks.{name}", "--tiny", *args)


def test_bench_decode_times_verify_against_decode(tmp_path):
    run_script("bench_decode", "--no-stacked", "--hlo", "--out", str(tmp_path))
    rows = [r for r in json.load(open(tmp_path / "bench_decode.json"))["rows"] if r["layout"] == "per_layer"]
    assert [r["batch"] for r in rows] == [1, 4]
    # Each case's optimized HLO beside the results, named in its row.
    assert all("fusion" in (tmp_path / r["hlo"]).read_text() for r in rows)
    for r in rows:
        assert r["step_ms"] > 0 and r["verify_tokens"] == 8
        assert r["forward_verify_ms"] > 0 and r["forward_decode_ms"] > 0
        assert r["verify_over_decode"] == r["forward_verify_ms"] / r["forward_decode_ms"]


def test_bench_lora_rows_and_kernel_counts(tmp_path):
    run_script("bench_lora", "--profile", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "bench_lora.json"))["rows"]
    # Profiled: the step without a pool and with one (the CPU trace has no device kernels: an error entry).
    assert ["profile" in r for r in rows] == [True, True, False, False]
    assert [(r["lora_pool"], r["distinct_adapters"]) for r in rows] == [(False, 0), (True, 0), (True, 1), (True, 4)]
    assert rows[0]["overhead_vs_no_pool"] == 0.0
    # The pool's step has more kernels than the one without it (its A matmuls, masks).
    assert rows[1]["step_kernels"] > rows[0]["step_kernels"] > 0
    assert all(r["device_step_ms"] > 0 and r["loop_step_ms"] > 0 for r in rows)


def test_device_profile_splits_busy_time_and_gaps_per_call():
    from benchmarks.device_profile import _device_kernel_events, summarise

    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}},
    ]
    kernels = []
    for call in range(2):  # each call: a gemv (10 us), a gap of 2 us, the attention kernel (4 us)
        t0 = call * 20.0
        kernels += [
            {"ph": "X", "pid": 1, "tid": 7, "ts": t0, "dur": 10.0, "name": "gemv_fusion"},
            {"ph": "X", "pid": 1, "tid": 7, "ts": t0 + 12, "dur": 4.0, "name": "paged_decode_s16_g4_n64"},
            {"ph": "X", "pid": 1, "tid": 9, "ts": t0, "dur": 16.0, "name": "fusion.1"},  # op summary: ignored
            {"ph": "X", "pid": 2, "tid": 3, "ts": t0, "dur": 50.0, "name": "PjitFunction(step)"},
        ]
    s = summarise(_device_kernel_events({"traceEvents": meta + kernels}), calls=2)
    assert s["kernels"] == 2 and s["busy_us"] == 14.0
    assert s["span_us"] == (20 + 16) / 2 and s["gaps_us"] == s["span_us"] - 14.0
    assert s["by_kind"]["matmul (cuBLAS / XLA gemm)"] == {"us": 10.0, "kernels": 1}
    assert s["by_kind"]["attention (Pallas)"] == {"us": 4.0, "kernels": 1}
    assert [t["name"] for t in s["top"]] == ["gemv_fusion", "paged_decode_s16_g4_n64"]


def _kernel_case(name, median_us, fraction, tbps, bundled_tbps=None):
    results = [
        {
            "variant": "default",
            "kernel": "jspec",
            "ok": True,
            "median_us": median_us,
            "fraction_of_copy_bw": fraction,
            "achieved_tbps": tbps,
        }
    ]
    if bundled_tbps:
        results.append(
            {
                "variant": "bundled",
                "kernel": "jax_bundled",
                "ok": True,
                "median_us": 2 * median_us,
                "fraction_of_copy_bw": fraction / 2,
                "achieved_tbps": bundled_tbps,
            }
        )
    return {"name": name, "results": results}


def test_roofline_verdicts_follow_the_issue_thresholds():
    from benchmarks.bench_roofline import evaluate

    kernels = {
        "cases": [
            _kernel_case("decode_b32_ctx4096_s16", 137.0, 0.91, 3.9, bundled_tbps=1.96),
            _kernel_case("decode_b32_ctx4096_s1", 160.0, 0.78, 3.4),  # 1.168x page 16: over 15%
            _kernel_case("decode_b32_ctx4096_s64", 136.0, 0.92, 3.94),
            _kernel_case("tree_b32_q8_ctx4096_s16", 165.0, 0.59, 3.25),
        ]
    }  # under 60%
    decode = {
        "rows": [
            {
                "batch": 64,
                "context": 1024,
                "layout": "per_layer",
                "step_ms": 7.7,
                "x_bandwidth_floor": 1.44,
                "bandwidth_floor_ms": 5.34,
                "matmul_floor_ms": 1.29,
                "verify_over_decode": 2.1,
                "verify_tokens": 8,
                "forward_verify_ms": 17.1,
                "forward_decode_ms": 8.2,
            },
            {
                "batch": 1,
                "context": 1024,
                "layout": "per_layer",
                "step_ms": 3.8,
                "x_bandwidth_floor": 1.12,
                "bandwidth_floor_ms": 3.38,
                "matmul_floor_ms": 0.02,
                "verify_over_decode": 1.2,
                "verify_tokens": 8,
                "forward_verify_ms": 6.0,
                "forward_decode_ms": 5.0,
            },
        ]
    }
    host = lambda model, method, h, d: {
        "model": model,
        "method": method,
        "batch": 1,  # noqa: E731
        "device_step_ms": d,
        "overlap_host_ms": {"host": h, "launch": h - 0.1},
    }
    overlap = {
        "rows": [host("small", "eagle3", 2.1, 1.3), host("8b", "eagle3", 2.3, 5.3), host("8b", "none", 2.3, 2.0)]
    }
    rows = {r["target"]: r for r in evaluate(kernels, decode, overlap)}
    met = {k: r["met"] for k, r in rows.items()}
    assert met["1 decode attention B=32 ctx 4096 page 16"] is True
    assert "1.96 TB/s" in rows["1 decode attention B=32 ctx 4096 page 16"]["note"]
    assert met["1 decode attention page 1 vs page 16"] is False
    assert met["1 decode attention page 64 vs page 16"] is True
    assert met["2 tree verify attention B=32 x 8 ctx 4096"] is False
    assert met["3 decode step bs=1 ctx 1024"] is True  # the bs=1 row, whatever the order
    assert met["3 decode step bs=64 ctx 1024"] is None  # reported, not graded
    assert "6.0x matmul floor" in rows["3 decode step bs=64 ctx 1024"]["figure"]
    assert met["4 verify 8 tokens vs decode, bs=1"] is False  # 1.2x > 1.1x
    assert met["5 host per iteration, small eagle3 bs=1"] is None
    graded = [r["met"] for r in evaluate(None, None, overlap) if r["target"].startswith("5") and "8b" in r["target"]]
    assert graded == [True, False]


def test_roofline_marks_what_did_not_run():
    from benchmarks.bench_roofline import evaluate

    rows = evaluate(None, None, None)
    assert [r["target"][0] for r in rows] == ["1", "2", "3", "4", "5"]
    assert all(r["figure"] == "not run" and r["met"] is None for r in rows)


def test_bench_roofline_dry_run_runs_its_parts_and_grades_their_targets(tmp_path):
    # bench_decode's own dry run is test_bench_decode_times_verify_against_decode: skipped here
    # for the suite's time, so its two targets read "not run".
    run_script("bench_roofline", "--skip", "decode", "--out", str(tmp_path))
    result = json.load(open(tmp_path / "bench_roofline.json"))
    runs = result["runs"]
    assert runs["decode"] == {"skipped": True} and (runs["kernels"]["rc"], runs["overlap"]["rc"]) == (0, 0)
    assert all(result["records"][name] for name in ("kernels", "overlap"))
    targets = result["targets"]
    assert {r["target"][0] for r in targets} == {"1", "2", "3", "4", "5"}
    assert {r["target"][0] for r in targets if r["figure"] == "not run"} == {"3", "4"}


def test_bench_adaptive_replays_every_workload(tmp_path):
    costs = tmp_path / "costs.json"
    flat = {"1": 1.0, "2": 1.2}
    costs.write_text(json.dumps({"costs": {"7,1,8": flat, "3,1,4": flat, "1,1,2": flat, "3,2,7": flat, "off": flat}}))
    run_script("bench_adaptive", "--cost-table", str(costs), "--out", str(tmp_path))
    result = json.load(open(tmp_path / "bench_adaptive.json"))
    assert result["settings"]["cost_source"] == f"loaded from {costs}"
    assert [r["workload"] for r in result["rows"]] == ["pays", "never_pays", "mixed"]
    for r in result["rows"]:
        # Every shape costs the same here: drafting never loses, so the policy never turns it off.
        assert r["adaptive"]["tokens"] == r["off"]["tokens"] and r["off"]["tokens_per_s"] <= r["7,1,8"]["tokens_per_s"]
        assert "off" not in r["adaptive"]["iterations"]


def test_bench_fp8_rows_against_bf16(tmp_path):
    run_script("bench_fp8", "--variants", "bf16,fp8_pallas_fp8kv", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "bench_fp8.json"))["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [(v, b) for v in ("bf16", "fp8_pallas_fp8kv") for b in (1, 4)]
    for r in rows:
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["tokens_per_s_vs_bf16"] > 0
    # FP8 weights read a quarter of f32's bytes (scales add 1/in), FP8 KV a quarter of its KV.
    bf16, fp8kv = rows[0], rows[-2]
    assert fp8kv["weight_mb"] < 0.3 * bf16["weight_mb"] and fp8kv["kv_mb"] == bf16["kv_mb"] / 4


def test_bench_fp8_gemv_sweeps_every_projection_and_checks_each_config(tmp_path):
    run_script("bench_fp8", "--gemv", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "bench_fp8_gemv.json"))["rows"]
    assert list(dict.fromkeys(r["projection"] for r in rows)) == ["qkv", "o", "gate_up", "down", "lm_head"]
    for name in ("qkv", "lm_head"):
        paths = [r["path"] for r in rows if r["projection"] == name]
        assert paths[0] == "xla" and paths.count("pallas") >= 3  # Mosaic only on a GPU
    # Every config ran and matched the dequantised product (interpreted on the CPU).
    assert all(r["ok"] and r["us"] > 0 for r in rows)


def test_gpu_tests_names_tests_that_exist():
    from benchmarks.gpu_tests import ENGINE_TESTS

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ENGINE_TESTS],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    collected = {line.strip() for line in done.stdout.splitlines()}
    assert set(ENGINE_TESTS) <= collected


def test_gpu_tests_counts_every_outcome(tmp_path):
    from benchmarks.gpu_tests import summarize

    def report(nodeid, when, outcome, **extra):
        return {"nodeid": nodeid, "when": when, "outcome": outcome, "s": 1.0, **extra}

    tests = summarize(
        [
            *(report("ok", w, "passed") for w in ("setup", "call", "teardown")),
            report("bad", "setup", "passed"),
            report("bad", "call", "failed"),
            report("bad", "teardown", "passed"),
            report("broken", "setup", "failed"),
            report("broken", "teardown", "passed"),
            report("skip", "setup", "skipped", reason="no HF"),
            report("skip", "teardown", "passed"),
            report("leaky", "setup", "passed"),
            report("leaky", "call", "passed"),
            report("leaky", "teardown", "failed"),
            report("cut", "setup", "passed"),  # the limit struck inside its call
        ]
    )
    outcomes = {n: t["outcome"] for n, t in tests.items()}
    assert outcomes == dict(ok="passed", bad="failed", broken="error", skip="skipped", leaky="error", cut="interrupted")
    assert tests["ok"]["s"] == 3.0 and tests["skip"]["reason"] == "no HF"

    # The whole script on two quick tests: its JSON and the fields it promises.
    nodes = [
        "tests/kernels/test_kernels.py::test_interpret_mode_follows_backend",
        "tests/kernels/test_kernels.py::test_choose_splits_fills_the_gpu_and_respects_bounds",
    ]
    done = run_module("benchmarks.gpu_tests", "--out", str(tmp_path), "--tests", *nodes)
    result = json.load(open(tmp_path / "gpu_tests.json"))
    assert result["counts"] == dict(passed=2, failed=0, skipped=0, error=0, interrupted=0)
    assert sorted(result["seconds"]) == sorted(nodes) and result["exit_code"] == 0 and not result["cut_short"]
    assert {"device", "jax_version", "commit"} <= result.keys()
    last = done.stdout.splitlines()[-3:]  # the table's row, then the summary line
    assert last[-2].split()[:2] == ["tests/kernels", "2"] and last[-1].endswith("gpu_tests.json")


def test_bench_one_row_forms_agree(tmp_path):
    # The Mosaic form is left out: interpreted it takes ~0.3 s a call, and its kernel has its own tests.
    run_script("bench_one_row", "--forms", "xla,xla_nk,padded,pallas_n32", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "bench_one_row.json"))["rows"]
    assert [r["form"] for r in rows] == ["xla", "xla_nk", "padded", "pallas_n32"]
    # The same chain each way: on the CPU every form's float32 sums agree to rounding.
    assert all(r["ms"] > 0 and r["max_abs_diff_vs_first"] < 1e-2 for r in rows)


def test_bench_logit_bias_checks_every_variant_before_timing(tmp_path):
    run_script("bench_logit_bias", "--out", str(tmp_path))
    rows = json.load(open(tmp_path / "bench_logit_bias.json"))["rows"]
    assert {(r["case"], r["variant"]) for r in rows} >= {
        ("decode R=4", "sparse_bias"),
        ("tree 2x3", "tree_penalties_sparse_bias"),
    }
    assert all(r["ms"] > 0 for r in rows)


def test_bench_call_cost_rows_and_slopes(tmp_path):
    run_script("bench_call_cost", "--out", str(tmp_path))
    data = json.load(open(tmp_path / "bench_call_cost.json"))
    # The Mosaic GPU kernel lowers only for a GPU: the CPU run leaves it out and says so.
    assert data["settings"]["backends"] == ["xla", "pallas"]
    for b in data["backends"]:
        assert [r["calls"] for r in b["rows"]] == [1, 2]
        assert all(r["dispatch_ms"] > 0 and r["program_ms"] > 0 for r in b["rows"])
        assert b["host_us_per_call"] is not None and b["device_us_per_call"] is not None


def test_bench_call_cost_chains_paged_decodes_over_a_pool_of_their_layers(tmp_path):
    """With --moving: the lengths every call reads come back as a new buffer each program."""
    run_script("bench_call_cost", "--kernel", "paged_decode", "--moving", "--out", str(tmp_path))
    data = json.load(open(tmp_path / "bench_call_cost_paged_decode_moving.json"))
    assert data["settings"]["backends"] == ["xla", "pallas"] and data["settings"]["context"] == 32
    assert data["settings"]["moving"] is True
    for b in data["backends"]:
        assert [r["calls"] for r in b["rows"]] == [1, 2]
        assert all(r["dispatch_ms"] > 0 and r["program_ms"] > 0 for r in b["rows"])


def test_serving_curve_reads_the_engines_token_gaps_over_one_run():
    from benchmarks.serving_curve import histogram_percentile, token_gap_split
    from jspec.engine.engine import TOKEN_GAP_BIN_MS, empty_token_gaps

    before, after = empty_token_gaps(), empty_token_gaps()
    before["decode"][3] = 5  # gaps from an earlier run: not this one's
    after["decode"][3], after["decode"][30] = 5 + 98, 1
    after["mixed"][60] = 1
    gaps = token_gap_split(before, after)
    assert gaps["decode"] == {"count": 99, "p50_ms": 4 * TOKEN_GAP_BIN_MS, "p99_ms": 31 * TOKEN_GAP_BIN_MS}
    assert gaps["mixed"]["count"] == 1 and gaps["mixed"]["p99_ms"] == 61 * TOKEN_GAP_BIN_MS
    # Over all 100 gaps the 99th is still the slow decode one, the mixed step's the 100th.
    assert gaps["all"]["count"] == 100 and gaps["all"]["p99_ms"] == 31 * TOKEN_GAP_BIN_MS
    assert histogram_percentile([0, 0], 99) is None and token_gap_split(None, after) is None


def test_bench_dflash_small_writes_every_shape_and_its_b1_profile(tmp_path):
    """The SmolLM2-shape run of bench_dflash: each block's cost per bucket beside the plain
    step's, and the B=1 trace of each (empty of kernels off the GPU, but named)."""
    run_module(
        "benchmarks.bench_dflash",
        "--small",
        "--dry-run",
        "--draft-layers",
        "1",
        "--repeats",
        "1",
        "--profile",
        "--out",
        str(tmp_path),
    )
    data = json.load(open(tmp_path / "bench_dflash_small.json"))
    assert data["settings"]["shape"] == "smollm2-135m"
    buckets = set(data["plain_s"])
    assert set(data["dflash_s"]) == {"15 1 16", "7 1 8", "0 1 1"}
    assert all(set(row) == buckets for row in data["dflash_s"].values())
    assert set(data["profile_b1"]) == {"plain", "DFLASH 15 1 16", "DFLASH 7 1 8", "DFLASH 0 1 1"}


def test_host_self_times_subtract_nested_events_per_thread():
    """A launch's self time is its span less the runtime events inside it on its own thread;
    another thread's events never nest in it; the profiler's own stop is left out."""
    from benchmarks.device_profile import host_self_times

    def meta(pid, name):
        return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}

    def event(name, ts, dur, tid=1, pid=1):
        return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            meta(1, "/host:CPU"),
            meta(2, "/device:GPU:0"),
            event("launch", 0, 10),
            event("execute", 1, 6),
            event("update", 2, 3),
            event("launch", 20, 4),
            event("other", 0, 5, tid=2),
            event("kernel", 0, 50, pid=2),
            event("$profiler.py:271 stop_trace", 30, 100),
        ]
    }
    got = host_self_times(trace, calls=2)
    assert got["self_us_per_call"] == {"launch": 4.0, "other": 2.5, "execute": 1.5, "update": 1.5}
    assert got["count_per_call"]["launch"] == 1.0


def test_bench_host_launch_idle_kept_and_traced(tmp_path):
    run_script("bench_host_launch", "--methods", "none", "--tokens", "8", "--trace", "--out", str(tmp_path))
    (row,) = json.load(open(tmp_path / "bench_host_launch.json"))["rows"]
    assert row["idle"]["launch_ms"] > 0 and row["idle"]["launch_outputs_kept_ms"] > 0
    host = row["loop_trace"]["host"]["self_us_per_call"]
    assert host and all(not name.startswith("$") for name in host)  # no Python frames traced
    assert len(row["generated_tokens"]) == 8


def test_va_remap_table_flags_a_setting_whose_tokens_differ(tmp_path):
    """launch_va_remap's table: each setting's launch beside the default's, and a setting that
    changed the generated tokens marked so (here a copy of a dry run with one token altered)."""
    run_script(
        "bench_host_launch",
        "--methods",
        "none",
        "--tokens",
        "4",
        "--name",
        "bench_host_launch_va_default",
        "--out",
        str(tmp_path),
    )
    data = json.load(open(tmp_path / "bench_host_launch_va_default.json"))
    for name, bump in (("same", 0), ("wrong", 1)):
        data["rows"][0]["generated_tokens"][-1] += bump
        json.dump(data, open(tmp_path / f"bench_host_launch_va_{name}.json", "w"))
    run_module("benchmarks.va_remap_table", str(tmp_path))
    rows = {r["setting"]: r for r in json.load(open(tmp_path / "bench_va_remap.json"))["rows"]}
    assert {s: r["same_tokens_as_default"] for s, r in rows.items()} == {"default": True, "same": True, "wrong": False}
    assert rows["default"]["allocator"] == "default" and rows["default"]["loop_launch_ms"] > 0


def test_bench_kernels_verify_small_sweeps_the_small_models_verify_tiles(tmp_path):
    run_module("benchmarks.bench_kernels", "--smoke", "--verify-small", "--out", str(tmp_path))
    case, served = json.load(open(tmp_path / "bench_kernels_verify_small.json"))["cases"]
    assert (case["num_q_heads"], case["num_kv_heads"], case["head_dim"], case["q_len"]) == (9, 3, 64, 16)
    plans = {r["variant"]: r["plan"] for r in case["results"]}
    # The default puts enough programs first at B=1: 16-row blocks, as the sweep's m16 variants.
    assert plans["default"]["block_m"] == 16 and plans["m16_splits4"]["block_m"] == 16
    # As served, the tables are wider than the context held, and the plan before is beside it.
    assert served["table_tokens"] > served["ctx"]
    served_plans = {r["variant"]: r["plan"] for r in served["results"]}
    assert served_plans["default"]["block_m"] == 16 and served_plans["before"]["block_m"] == 64
    assert all(r["rel_err"] < 1e-2 for r in case["results"] + served["results"])


def test_serving_curve_variants_carry_environment_words():
    from benchmarks.serving_curve import split_env

    env, flags = split_env("A_B=1 'XLA_FLAGS=--x=1 --y=SKIP_TEMP' --mixed-chunk-slowdown 2 --tag K=V")
    assert env == {"A_B": "1", "XLA_FLAGS": "--x=1 --y=SKIP_TEMP"}
    assert flags == "--mixed-chunk-slowdown 2 --tag K=V"  # only leading words are environment
    assert split_env("") == ({}, "")

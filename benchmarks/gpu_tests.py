"""The tests that mean something on a GPU, run compiled there in one pass: tests/kernels (every
kernel against its reference, and the lowering tests) and ENGINE_TESTS, one or two engine tests
per feature on tiny models. Writes DIR/gpu_tests.json (pass / fail / skip / error counts, the
failing node ids, each test's seconds, device, jax version, commit) and prints a table last.

    python -m benchmarks.gpu_tests [--out benchmarks/results] [--kernels-only] [--limit-s 270]
        [--engine-only] [--shard I/N] [--name gpu_tests] [--tests NODEID ...]

Each test picks its own precision (docs/design-details.md, "Precision"): the kernel tests run
at JAX's default matmul precision (TF32 float32 dots on the GPU) and owe TF32-sized
tolerances; the engine tests claim token-for-token equality, which holds in exact float32
arithmetic, so tests/conftest.py sets highest for them on the GPU. Off the GPU the pass is a dry
run of this script (the kernels run interpreted; the CPU suite runs these tests anyway).

pytest runs in a child process, with this module as a plugin that logs every test's report as
it ends: a pass cut short by --limit-s (pytest is interrupted, then killed) still reports what
ran. The DeepSeek (MLA) tests need transformers to write their checkpoint: where this python
has torch and transformers they run on it, else they skip, saying so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

# No jax or jspec up here: the pytest child imports this module as a plugin before
# tests/conftest.py sets XLA_FLAGS, so nothing may start a backend on import.

LOG_ENV = "JSPEC_GPU_TESTS_LOG"  # where the child's plugin appends its reports

KERNEL_TESTS = ["tests/kernels"]

# In the order they run (after the kernel tests), the likeliest to break on a GPU first, so that
# a pass cut short loses the least. "kernels": the engines take the backend's attention or name
# "pallas", so the Pallas kernels run; "reference": they pin the jnp reference attention (the
# feature's own device code still runs compiled).
ENGINE_TESTS = [
    # Plain decoding, page sizes 1 and 16, overlap on, against a dense recompute (kernels).
    "tests/engine/test_generate.py::test_paged_greedy_equals_dense_recompute[1-pallas]",
    "tests/engine/test_generate.py::test_paged_greedy_equals_dense_recompute[16-pallas]",
    # EAGLE chains, EAGLE-3 trees: lossless against plain decoding, overlap on (kernels).
    "tests/speculative/test_spec_eagle.py::test_agreeing_draft_is_lossless_and_accepts_everything[EAGLE-16-3-1-None-pallas]",
    "tests/speculative/test_spec_eagle.py::test_random_draft_is_lossless[EAGLE3-16-5-4-8-pallas]",
    "tests/speculative/test_spec_eagle.py::test_iteration_updates_the_target_pool_in_place[4-8]",
    # Sliding windows under EAGLE-3 trees; soft-capping (Gemma 2) and attention sinks (gpt-oss's
    # attention) with windows, under STANDALONE (kernels).
    "tests/speculative/test_spec_methods.py::test_speculation_over_sliding_windows_is_lossless[EAGLE3-16-2-pallas]",
    "tests/speculative/test_spec_families.py::test_standalone_draft_of_the_same_family_is_lossless[gemma2-16-2]",
    "tests/speculative/test_spec_families.py::test_standalone_draft_of_the_same_family_is_lossless[gpt_oss_attention-16-1]",
    # STANDALONE trees at page 4, NGRAM trees at page 1, overlap on (reference).
    "tests/speculative/test_spec_methods.py::test_standalone_random_draft_is_lossless[4-True-3-2-5]",
    "tests/speculative/test_spec_methods.py::test_ngram_is_lossless_and_accepts_repetitive_text[1-True-3]",
    # FP8 weights (the GEMV or XLA's dot) and the FP8 KV pool under EAGLE-3 (reference).
    "tests/models/test_fp8_engine.py::test_quantization_fp8_equals_its_dequantised_weights",
    "tests/models/test_fp8_engine.py::test_fp8_kv_speculative_greedy_equals_plain_with_prefix_cache",
    # A grammar row under an EAGLE-3 tree, overlap on (reference).
    "tests/constrained/test_structured.py::test_speculation_emits_the_plain_engines_tokens[EAGLE3-2-True-False-False]",
    # LoRA adapters in a mixed batch under EAGLE-3 (reference).
    "tests/engine/test_lora.py::test_mixed_batch_with_eagle3_is_lossless",
    # Penalties under sampled speculation (trees); logprobs against a dense recompute (reference).
    "tests/engine/test_penalties.py::test_speculative_penalties_equal_plain[0.7-3-2-5]",
    "tests/engine/test_logprobs.py::test_logprobs_match_a_dense_recompute_and_spec_matches_plain",
    # Adaptive speculation's forced switches, overlap on (reference).
    "tests/speculative/test_adaptive.py::test_forced_switches_equal_plain_decoding[EAGLE-16-True]",
    # NEXTN: MiMo's MTP layer on standard attention (reference); DeepSeek-V3's over the MLA
    # kernels (kernels; needs transformers to write its checkpoint).
    "tests/speculative/test_nextn_mimo.py::test_mimo_nextn_greedy_equals_plain_greedy[16-True-3-1-None]",
    "tests/models/test_deepseek.py::test_nextn_greedy_equals_plain_greedy[4-True-2-2-4-pallas]",
    # DFLASH's block drafts, with sampling, penalties and logprobs, against plain (reference).
    "tests/speculative/test_spec_dflash.py::test_outputs_equal_plain_and_drafts_equal_the_dense_drafter",
    # The small projection weights laid out [out, in] (the one-GPU default), plain and verifying.
    "tests/engine/test_generate.py::test_out_in_projections_give_the_default_tokens[llama]",
    "tests/engine/test_generate.py::test_out_in_projections_give_the_default_tokens[llama-ngram]",
]


# ---- the plugin: loaded into the pytest child with -p benchmarks.gpu_tests ----------------------


def _log(record: dict) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report) -> None:
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "s": report.duration}
    if report.skipped and isinstance(report.longrepr, tuple):
        record["reason"] = str(report.longrepr[2])
    _log(record)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The tests in the order of the command line's arguments (tests/conftest.py sorts the slow
    files first, for the CPU suite's workers)."""
    args = [a.rstrip("/") for a in config.args]

    def rank(item) -> int:
        within = (item.nodeid == a or item.nodeid.startswith((a + "/", a + "::")) for a in args)
        return next((i for i, inside in enumerate(within) if inside), len(args))

    items.sort(key=rank)


def pytest_collectreport(report) -> None:
    if report.failed:
        _log({"nodeid": report.nodeid, "when": "collect", "outcome": "failed", "s": 0.0})


# ---- the parent ---------------------------------------------------------------------------------


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per test: its outcome and seconds (setup, call and teardown). Outcomes: passed, failed,
    skipped, error (a failure outside the test body, or its module's collection) and
    interrupted (set up, never finished: the limit cut the pass short there)."""
    tests: dict[str, dict] = {}
    for r in records:
        t = tests.setdefault(r["nodeid"], {"outcome": "interrupted", "s": 0.0})
        t["s"] += r["s"]
        if r["outcome"] == "failed":
            t["outcome"] = "failed" if r["when"] == "call" else "error"
        elif r["outcome"] == "skipped":
            t["outcome"], t["reason"] = "skipped", r.get("reason", "")
        elif r["when"] == "call" and t["outcome"] == "interrupted":
            t["outcome"] = "passed"
    return tests


def child_env(log: str) -> dict[str, str]:
    """The pytest child's environment: where to log, and this python as the HF oracle's when it
    has torch and transformers (and no other is set)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env[LOG_ENV] = log
    if "JSPEC_HF_PYTHON" not in env and all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
        env["JSPEC_HF_PYTHON"] = sys.executable
    return env


def collectable(nodes: list[str], env: dict[str, str], cwd: str) -> tuple[list[str], list[str]]:
    """(the node ids pytest collects here, those it does not): a module that skips itself for a
    package this machine lacks would otherwise stop the whole pass before its first test."""
    files = sorted({n.split("::")[0] for n in nodes if "::" in n})
    if not files:
        return nodes, []
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    found = {line.strip() for line in done.stdout.splitlines()}
    kept = [n for n in nodes if "::" not in n or n in found]
    return kept, [n for n in nodes if n not in kept]


def run_pytest(nodes: list[str], env: dict[str, str], cwd: str, limit_s: float) -> tuple[int, bool]:
    """(pytest's exit code, whether the limit cut it short)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "benchmarks.gpu_tests"]
    proc = subprocess.Popen([*cmd, *nodes], cwd=cwd, env=env)
    try:
        return proc.wait(timeout=limit_s), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # pytest stops after the current test and reports
        try:
            return proc.wait(timeout=20), True
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), True


def table(tests: dict[str, dict]) -> list[str]:
    groups: dict[str, dict] = {}
    for nodeid, t in tests.items():
        g = groups.setdefault(
            "/".join(nodeid.split("/")[:2]), dict(passed=0, failed=0, skipped=0, error=0, interrupted=0, s=0.0)
        )
        g[t["outcome"]] += 1
        g["s"] += t["s"]
    lines = [f"{'group':<16}{'passed':>8}{'failed':>8}{'skipped':>9}{'error':>7}{'time':>10}"]
    for name, g in sorted(groups.items()):
        lines.append(f"{name:<16}{g['passed']:>8}{g['failed']:>8}{g['skipped']:>9}{g['error']:>7}{g['s']:>8.1f} s")
    return lines


def main() -> None:
    from benchmarks.common import REPO_ROOT, RESULTS_DIR, Results

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--kernels-only", action="store_true", help="tests/kernels alone")
    ap.add_argument("--engine-only", action="store_true", help="ENGINE_TESTS alone")
    ap.add_argument("--name", default="gpu_tests", help="the results file's name")
    ap.add_argument(
        "--shard", help="I/N: the I-th of N interleaved parts of the engine list (each part fits a device call)"
    )
    ap.add_argument("--limit-s", type=float, default=255.0, help="interrupt pytest after this many seconds")
    ap.add_argument("--tests", nargs="+", help="these node ids instead of the pass's")
    a = ap.parse_args()
    engine_tests = ENGINE_TESTS
    if a.shard:
        i, n = map(int, a.shard.split("/"))
        if not 1 <= i <= n:
            ap.error(f"--shard {a.shard}: I must be 1..N")
        engine_tests = ENGINE_TESTS[i - 1 :: n]
    nodes = a.tests or (
        KERNEL_TESTS if a.kernels_only else engine_tests if a.engine_only else KERNEL_TESTS + engine_tests
    )

    with tempfile.TemporaryDirectory(prefix="jspec-gpu-tests-") as tmp:
        log = os.path.join(tmp, "reports.jsonl")
        env = child_env(log)
        t0 = time.perf_counter()
        nodes, not_collected = collectable(nodes, env, REPO_ROOT)
        exit_code, cut_short = run_pytest(nodes, env, REPO_ROOT, a.limit_s - (time.perf_counter() - t0))
        wall = time.perf_counter() - t0
        records = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
    tests = summarize(records)
    outcomes = ("passed", "failed", "skipped", "error", "interrupted")
    by = {k: sorted(n for n, t in tests.items() if t["outcome"] == k) for k in outcomes}

    # The backend starts here only now that the child is gone (on a GPU it would take memory).
    settings = dict(tests=nodes, limit_s=a.limit_s, JSPEC_HF_PYTHON=env.get("JSPEC_HF_PYTHON"))
    path = Results(a.out, a.name, settings).write(
        exit_code=exit_code,
        cut_short=cut_short,
        not_collected=not_collected,
        wall_s=round(wall, 1),
        counts={k: len(v) for k, v in by.items()},
        failed=by["failed"],
        errors=by["error"],
        interrupted=by["interrupted"],
        skipped={n: tests[n].get("reason", "") for n in by["skipped"]},
        seconds=dict(sorted(((n, round(t["s"], 2)) for n, t in tests.items()), key=lambda kv: -kv[1])),
    )
    import jax

    print()
    print(f"gpu_tests on {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}:")
    print("\n".join(table(tests)))
    for n in by["failed"] + by["error"] + by["interrupted"]:
        print(f"{tests[n]['outcome']:>11}  {n}")
    if cut_short:
        print(f"cut short at {a.limit_s:.0f} s: the tests after those counted here did not run")
    for n in not_collected:
        print(f"not collected here (a module skipped for a missing package?): {n}")
    print(f"{len(tests)} tests in {wall:.0f} s, pytest exit code {exit_code}: {path}")


if __name__ == "__main__":
    main()

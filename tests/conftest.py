"""Suite-wide fixtures."""

import gc
import json
import os

# Eight CPU devices, so the sharding tests (tensor parallel, ...) find a mesh; set before
# jax starts. Everything else still runs on device 0.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite's time is mostly XLA:CPU compiling tiny programs; LLVM's cheaper passes cut it by
# ~15% and the programs are too small for the slower code to matter.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

import jax  # noqa: E402
import pytest
from support.precision import emulate_tf32_dots  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _tf32_emulation():
    """JSPEC_EMULATE_TF32=1: every test runs its dots as the GPU does (support/precision.py), so
    that the GPU's tolerances can be checked on the CPU."""
    if not os.environ.get("JSPEC_EMULATE_TF32"):
        yield
        return
    with emulate_tf32_dots():
        yield


@pytest.fixture(autouse=True, scope="module")
def _float32_dots_in_float32_for_engines(request):
    """On the GPU the tests that build engines run every float32 dot in float32 (XLA's and the
    kernels'): they claim token for token equality of algorithms (speculative against plain
    decoding, paged against a dense recompute), which holds in exact float32 arithmetic, not in
    TF32's. Set globally, not by the thread-local context manager: engines compile on threads.
    Module-scoped, and autouse, so that it comes before the modules' own fixtures, some of which
    run engines."""
    if request.node.get_closest_marker("slow") is None or jax.default_backend() != "gpu":
        yield
        return
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every module's compiled programs when it ends: the suite compiles hundreds of
    XLA:CPU executables, and keeping them all alive only grows the process (2 cores, 24 GiB)."""
    yield
    jax.clear_caches()
    gc.collect()


# The slowest files first (ordered by their seconds in a run with an empty compilation cache;
# `--durations=0` refreshes it): with `--dist loadfile` xdist hands out whole files in queue
# order, so a slow file picked up last would leave the other worker idle at the end.
SLOW_FILES_FIRST = (
    "test_hf_parity.py",
    "test_bench_scripts.py",
    "test_spec_methods.py",
    "test_server.py",
    "test_spec_eagle.py",
    "test_dp_attention.py",
    "test_adaptive.py",
    "test_lora.py",
    "test_generate.py",
    "test_spec_families.py",
    "test_kernels.py",
    "test_programs.py",
    "test_tensor_parallel.py",
    "test_engine.py",
    "test_fp8_engine.py",
    "test_deepseek.py",
    "test_moe.py",
    "test_spec_dflash.py",
    "test_penalties.py",
    "test_paged_decode_mgpu.py",
    "test_structured.py",
    "test_train_eagle.py",
    "test_real_model.py",
    "test_device_sizing.py",
    "test_logprobs.py",
    "test_paged_extend_mgpu.py",
    "test_sampling.py",
    "test_pd_disagg.py",
    "test_engine_process.py",
    "test_spec_sampling.py",
    "test_loader.py",
    "test_rope_kv.py",
)


def pytest_configure(config):
    """xdist (3.x) reorders loadfile's queue by each file's number of tests unless told not to,
    which would undo SLOW_FILES_FIRST: a slow file of few tests went out late."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order stays


# JSPEC_TEST_COMPILE_STATS=PREFIX: each test file's compile work (JAX's monitoring events:
# backend compiles and their seconds, persistent-cache hits, tracing and lowering) is written to
# PREFIX.<worker>.json at the end, to find where the suite's time goes (scripts/compile_stats.py).
_compile_stats: dict = {}
_current_file = ["(collection)"]


def _record(event: str, seconds: float | None = None) -> None:
    per = _compile_stats.setdefault(_current_file[0], {})
    count, total = per.get(event, (0, 0.0))
    per[event] = (count + 1, total + (seconds or 0.0))


if os.environ.get("JSPEC_TEST_COMPILE_STATS"):
    jax.monitoring.register_event_listener(lambda event, **_: _record(event) if "compil" in event else None)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: _record(event, seconds) if "/compile" in event else None
    )

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item):
        _current_file[0] = item.path.name

    def pytest_sessionfinish(session):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{os.environ['JSPEC_TEST_COMPILE_STATS']}.{worker}.json", "w") as f:
            json.dump(_compile_stats, f, indent=1)

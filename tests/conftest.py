"""Suite-wide fixtures."""

import gc
import os

# Eight CPU devices, so the sharding tests (tensor parallel, ...) find a mesh; set before
# jax starts. Everything else still runs on device 0.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every module's compiled programs when it ends: the suite compiles hundreds of
    XLA:CPU executables, and keeping them all alive only grows the process (2 cores, 24 GiB)."""
    yield
    jax.clear_caches()
    gc.collect()

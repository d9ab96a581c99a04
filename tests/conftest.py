"""Suite-wide fixtures."""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every module's compiled programs when it ends: the suite compiles hundreds of
    XLA:CPU executables, and keeping them all alive only grows the process (2 cores, 24 GiB)."""
    yield
    jax.clear_caches()
    gc.collect()

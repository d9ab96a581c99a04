"""The hidden-sync guard (tests/support/sync_guard.py) and the designated read point."""

from __future__ import annotations

import operator
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.sync_guard import count_device_reads

from jspec.scheduler.sync import designated_read, start_host_copy


@jax.jit
def _step(x):
    return x * 2 + 1


def test_transfer_guard_is_silent_on_cpu():
    """Why sync_guard exists: jax's own guard lets these through on the CPU."""
    if jax.default_backend() != "cpu":
        pytest.skip("the transfer guard works off the CPU")
    x = _step(jnp.arange(4))
    with jax.transfer_guard_device_to_host("disallow"):
        np.asarray(x)
        jax.device_get(x)
        int(x[0])


READS = {
    "np.asarray": lambda x: np.asarray(x),
    "np.array": lambda x: np.array(x),
    "numpy ufunc": lambda x: np.add(x, 1),
    "int": lambda x: int(x[0]),
    "float": lambda x: float(x[0]),
    "bool": lambda x: bool(x[0]),
    "if": lambda x: 1 if x[0] == 1 else 0,
    "index": lambda x: operator.index(x[0]),
    "list index": lambda x: [0, 1, 2][x[0]],
    "item": lambda x: x[0].item(),
    "tolist": lambda x: x.tolist(),
    "tobytes": lambda x: x.tobytes(),
    "f-string": lambda x: f"{x[0]}",
    "repr": lambda x: repr(x),
    "device_get": lambda x: jax.device_get(x),
    "device_get tree": lambda x: jax.device_get({"a": x, "b": [x + 1]}),
    "block_until_ready": lambda x: x.block_until_ready(),
    "jax.block_until_ready": lambda x: jax.block_until_ready((x, x + 1)),
    "memoryview": lambda x: memoryview(x),
    "np.testing": lambda x: np.testing.assert_array_equal(x, x),
}


@pytest.mark.parametrize("name", READS)
def test_catches_each_read(name):
    x = _step(jnp.arange(4, dtype=jnp.int32))
    with count_device_reads(check=False) as reads:
        READS[name](x)
    assert len(reads.hidden) >= 1 and not reads.designated
    # Reads nested inside one another count once (int() reads through _value, etc.).
    if name != "np.testing":  # it reads each argument
        assert len(reads.hidden) == 1, reads.report()
    assert "test_sync_guard.py" in reads.hidden[0].where


def test_fails_at_exit_with_a_stack():
    x = _step(jnp.arange(3))
    with pytest.raises(AssertionError, match=r"(?s)1 device read.*int\(\) of int32\[\] at test_sync_guard.py:\d+"):
        with count_device_reads():
            int(x[1])


def test_strict_fails_at_the_read():
    x = _step(jnp.arange(3))
    with count_device_reads(strict=True, check=False) as reads:
        with pytest.raises(AssertionError, match="hidden device read"):
            x[0].item()
        with pytest.raises(AssertionError, match="hidden device read"):
            np.asarray(x)
    assert reads.hidden


def test_body_error_is_not_masked():
    x = _step(jnp.arange(3))
    with pytest.raises(KeyError):
        with count_device_reads():
            int(x[0])
            raise KeyError("from the body")


def test_designated_read_allowed_and_counted():
    out = {"tokens": _step(jnp.arange(4)), "lens": _step(jnp.ones(2, jnp.int32)), "none": None}
    with count_device_reads() as reads:
        start_host_copy(out)  # starting a copy is not a read
        host = designated_read(out)
    assert len(reads.designated) == 2 and not reads.hidden
    assert isinstance(host["tokens"], np.ndarray) and host["none"] is None
    np.testing.assert_array_equal(host["tokens"], [1, 3, 5, 7])
    np.testing.assert_array_equal(host["lens"], [3, 3])


def test_reads_of_numpy_and_python_values_not_counted():
    a = np.arange(5)
    with count_device_reads() as reads:
        np.asarray(a), int(a[1]), a.tolist(), bool(a[2]), jax.device_get(a), jax.device_get({"k": 3})
        jax.block_until_ready(a)
        designated_read(a)  # numpy through the designated point: no device read either
        y = _step(jnp.asarray(a))  # host -> device and dispatch are not reads
        y = y + jnp.sum(y)
    assert not reads.hidden and not reads.designated
    assert np.asarray(y).tolist() == [26, 28, 30, 32, 34]


def test_reads_in_other_threads_are_counted():
    x = _step(jnp.arange(3))
    with count_device_reads(check=False) as reads:
        t = threading.Thread(target=lambda: x.tolist())
        t.start()
        t.join()
    assert [r.kind for r in reads.hidden] == [".tolist()"]


def test_jax_works_normally_after_exit():
    x = _step(jnp.arange(4))
    before = {n: getattr(type(x), n) for n in ("__array__", "__buffer__", "__int__", "_value", "item")}
    with pytest.raises(AssertionError):
        with count_device_reads():
            np.asarray(x)
    after = {n: getattr(type(x), n) for n in ("__array__", "__buffer__", "__int__", "_value", "item")}
    assert before == after
    # Reads work, uncounted, and the guard can be entered again.
    assert np.asarray(x).tolist() == [1, 3, 5, 7] and int(x[3]) == 7 and x[0].item() == 1
    assert jax.device_get(x).sum() == 16 and bool(x[1] == 3)
    assert jax.device_get.__name__ == "device_get" and not hasattr(jax.device_get, "__wrapped__")
    with count_device_reads() as reads:
        designated_read(x)
    assert len(reads.designated) == 1
    with count_device_reads():
        with pytest.raises(RuntimeError, match="nest"):
            with count_device_reads():
                pass

"""Counts host reads of device arrays, to catch hidden syncs in CPU tests.

`jax.transfer_guard_device_to_host("disallow")` does not fire on the CPU
backend in jax 0.11.2 (np.asarray, jax.device_get, int(), .item(), .tolist(),
bool() and block_until_ready all pass under it), so a CPU test of the overlap
loop's "one sync per step" rule needs its own guard. This one patches every
way host code reads a jax array, on the concrete array class (jax.Array's
ArrayImpl), and records each read with a short stack:

- the buffer protocol (`__buffer__`): what np.asarray, np.array and numpy
  ufuncs use on the CPU, before ever trying `__array__`;
- `__array__` (np.asarray on accelerators, jax.device_get per leaf);
- `_value`, the property every read ends in: a catch-all for paths not named here;
- `.item()`, `.tolist()`, `.tobytes()`, `bool()`, `int()`, `float()`,
  `complex()`, `operator.index()`, `hex()`, `oct()`, `format()`, `repr()`,
  `str()`, `.block_until_ready()`;
- the functions `jax.device_get` and `jax.block_until_ready` (one read per call).

A read nested in another (int() -> _value) counts once, as the outer one.
Reads made inside `jspec.scheduler.sync.designated_read`, the loop's one sync
point, are counted apart and allowed. `copy_to_host_async` is not a read.

    with count_device_reads() as reads:        # AssertionError at exit on a hidden read
        engine.step(); engine.step()
    assert len(reads.designated) == 2

    with count_device_reads(strict=True): ...  # AssertionError at the read itself
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jaxlib
import numpy as np
from jax._src.array import ArrayImpl  # the concrete class behind jax.Array; its methods are the ones to patch

from jspec.scheduler import sync

_METHODS = {
    "__buffer__": "np.asarray (buffer protocol)",
    "__array__": "np.asarray (__array__)",
    "item": ".item()",
    "tolist": ".tolist()",
    "tobytes": ".tobytes()",
    "__bool__": "bool()",
    "__int__": "int()",
    "__float__": "float()",
    "__complex__": "complex()",
    "__index__": "operator.index()",
    "__hex__": "hex()",
    "__oct__": "oct()",
    "__format__": "format()",
    "__repr__": "repr()",
    "__str__": "str()",
    "block_until_ready": ".block_until_ready()",
}
_FUNCTIONS = {"device_get": "jax.device_get", "block_until_ready": "jax.block_until_ready"}
_MISSING = object()

# Frames of these files are left out of a read's stack: they say how, not where.
_SKIP_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (jax, jaxlib, np)) + (
    os.path.abspath(__file__),
    contextlib.__file__,
    threading.__file__,
)


class _Depth(threading.local):
    depth = 0  # > 0 while a patched read runs in this thread: inner reads are not counted again


_local = _Depth()
_active: DeviceReads | None = None


@dataclasses.dataclass(frozen=True)
class DeviceRead:
    kind: str  # how it was read, e.g. "int()"
    what: str  # shape and dtype of the array (never its value: that would read it)
    where: str  # innermost caller frames outside jax/numpy, innermost first

    def __str__(self) -> str:
        return f"{self.kind} of {self.what} at {self.where}"


@dataclasses.dataclass
class DeviceReads:
    """What a `count_device_reads` block saw."""

    strict: bool = False
    hidden: list[DeviceRead] = dataclasses.field(default_factory=list)  # reads outside designated_read
    # Reads inside designated_read: one per array leaf it converted.
    designated: list[DeviceRead] = dataclasses.field(default_factory=list)

    def report(self) -> str:
        lines = [
            f"{len(self.hidden)} device read(s) outside jspec.scheduler.sync.designated_read "
            f"({len(self.designated)} through it):"
        ]
        lines += [f"  {r}" for r in self.hidden]
        return "\n".join(lines)

    def _record(self, kind: str, what: str) -> None:
        read = DeviceRead(kind, what, _where())
        if _in_designated_read():
            self.designated.append(read)
            return
        self.hidden.append(read)
        if self.strict:
            raise AssertionError(f"hidden device read: {read}")


def _describe(x: Any) -> str:
    if isinstance(x, jax.Array):
        return f"{x.dtype}{list(x.shape)}"
    n = sum(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(x))
    return f"a tree of {n} device array(s)"


def _where(frames: int = 4) -> str:
    stack = [f for f in traceback.extract_stack() if not f.filename.startswith(_SKIP_DIRS)]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack[-frames:]))


def _in_designated_read() -> bool:
    code = sync.designated_read.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _counting(kind: str, fn: Callable, count_if: Callable[[Any], bool]) -> Callable:
    """`fn` that records a read of its first argument (when `count_if` says it is one)."""

    def wrapper(x, *args, **kwargs):
        guard = _active
        if guard is not None and _local.depth == 0 and count_if(x):
            guard._record(kind, _describe(x))
        _local.depth += 1
        try:
            return fn(x, *args, **kwargs)
        finally:
            _local.depth -= 1

    wrapper.__name__ = getattr(fn, "__name__", kind)
    wrapper.__wrapped__ = fn
    return wrapper


def _always(x: Any) -> bool:
    return True


def _has_device_array(tree: Any) -> bool:
    return any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(tree))


@contextlib.contextmanager
def count_device_reads(strict: bool = False, check: bool = True) -> Iterator[DeviceReads]:
    """Counts host reads of jax arrays in the block (all threads).

    check: raise AssertionError at exit if a read happened outside
    `designated_read` (unless the block itself raised). strict: raise at the
    read instead, so the traceback points at it. Note that numpy swallows an
    error raised from the buffer protocol and retries through `__array__`, so
    one strict np.asarray records two reads before raising.
    """
    global _active
    if _active is not None:
        raise RuntimeError("count_device_reads does not nest")
    reads = DeviceReads(strict=strict)
    saved: list[tuple[Any, str, Any]] = []  # (owner, name, original attribute or _MISSING)

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, value)

    try:
        for name, kind in _METHODS.items():
            if hasattr(ArrayImpl, name):
                patch(ArrayImpl, name, _counting(kind, getattr(ArrayImpl, name), _always))
        value = ArrayImpl.__dict__["_value"]  # a property: wrap its getter
        patch(ArrayImpl, "_value", property(_counting("._value", value.fget, _always)))
        for name, kind in _FUNCTIONS.items():
            patch(jax, name, _counting(kind, getattr(jax, name), _has_device_array))
        _active = reads
        yield reads
    finally:
        _active = None
        for owner, name, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    # Only reached when the block did not raise: never hide its own error.
    if check and reads.hidden:
        raise AssertionError(reads.report())

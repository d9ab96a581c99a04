"""Compiled step programs kept on disk, so that a restart skips tracing and lowering too.

JAX's persistent compilation cache keys a program by its lowered module, so a warm start still
traces and lowers every program in Python before the cache can answer: with per-layer weights
that is most of a warm start, and the GIL serialises it across the warm-up's threads. This cache
keys a program by what it is made from instead (jspec's own source, the versions and backend,
the XLA settings, the step, its static arguments and its arguments' types) and stores the
executable itself (`jax.experimental.serialize_executable`). vLLM keys its compile cache the
same way: any change to the code or the configuration is a new key, never a stale program.

A program whose static arguments are not plain values (numbers, strings, enums, dataclasses of
those) gets no key and compiles through JAX as before; so do sharded programs (a mesh), whose
executables would need the mesh's devices to load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import config as jax_config  # trace_context(): the flags JAX's own jit cache keys on
from jax.experimental import serialize_executable

log = logging.getLogger("jspec.worker.executables")

# Off while code patches JAX's functions during tracing (tests/support/precision.py emulates the
# GPU's TF32 dots that way): a stored program would not carry the patch.
ENABLED = True


class Unkeyable(Exception):
    """A value whose text does not determine it (an object without a stable description)."""


def plain_text(value) -> str:
    """A text that determines `value`: plain values, containers and dataclasses of them.
    Raises Unkeyable for anything else."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(plain_text(v) for v in value)})"
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({', '.join(sorted(plain_text(v) for v in value))})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{plain_text(k)}: {plain_text(v)}" for k, v in sorted(value.items(), key=str)) + "}"
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return f"dtype({np.dtype(value).name})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={plain_text(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    raise Unkeyable(type(value).__qualname__)


@functools.cache
def source_fingerprint() -> str:
    """A hash of every Python file of the jspec package: a code change is a new key."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def environment_text() -> str:
    """The versions, backend, devices and XLA settings a program compiles against, and every
    JSPEC_ environment variable: the layers' kernel switches (JSPEC_ROPE_KV, ...) are read when
    a step is traced, so two processes that differ in one trace different programs from the
    same code. Variables that change nothing traced cost only a fresh compile."""
    devices = jax.devices()
    switches = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("JSPEC_")))
    return (
        plain_text(
            (
                jax.__version__,
                _version("jaxlib"),
                devices[0].client.platform,
                devices[0].client.platform_version,
                tuple(d.device_kind for d in devices),
                os.environ.get("XLA_FLAGS", ""),
                switches,
            )
        )
        + trace_config_text()
    )


def trace_config_text() -> str:
    """The configuration JAX's own jit cache keys a trace on (matmul precision, x64, ... and
    their thread-local overrides). An entry without a stable text (an object at an address: the
    empty axis environment of a top-level trace) counts by its type."""
    parts = []
    for value in jax_config.trace_context():
        try:
            parts.append(plain_text(value))
        except Unkeyable:
            text = repr(value)
            parts.append(type(value).__qualname__ if " at 0x" in text else text)
    return "|".join(parts)


def argument_text(args: tuple) -> str:
    """The arguments' tree, and each leaf's type and placement (not its values)."""
    leaves, tree = jax.tree.flatten(args)
    parts = [str(tree)]
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            parts.append(f"{jax.typeof(leaf)}@{leaf.sharding}")
        else:
            parts.append(str(jax.typeof(leaf)))
    return "|".join(parts)


def one_device(args: tuple):
    """The one device every array argument lives on; None when they span several."""
    devices = {d for leaf in jax.tree.leaves(args) if isinstance(leaf, jax.Array) for d in leaf.sharding.device_set}
    return devices.pop() if len(devices) == 1 else None


def program_key(step: Callable, static: dict, args: tuple, compiler_options: dict) -> str | None:
    """The file name a program is stored under, or None when it cannot be keyed safely."""
    try:
        text = "\n".join(
            (
                source_fingerprint(),
                environment_text(),
                f"{step.__module__}.{step.__qualname__}",
                plain_text(static),
                plain_text(compiler_options),
                argument_text(args),
            )
        )
    except Unkeyable as e:
        log.debug("no executable key (%s): compiled through JAX's cache", e)
        return None
    return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass
class ExecutableCache:
    """Serialized executables in `folder`, one file per program key."""

    folder: str
    loaded: int = 0  # programs this process loaded from here

    def load(self, key: str, device) -> Any | None:
        """The stored program, loaded onto `device`, ready to call; None when absent or
        unreadable (then removed)."""
        path = os.path.join(self.folder, key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree = pickle.load(f)
            fn = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, backend=device.client, execution_devices=[device]
            )
        except Exception as e:  # a truncated file, another jaxlib's format: compile afresh
            log.warning("dropping unreadable executable %s: %s", path, e)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            return None
        self.loaded += 1
        return fn

    def save(self, key: str, compiled) -> None:
        """Stores a compiled program (written to a temporary file, then renamed: readers never
        see half a file). A program XLA cannot serialize is left out."""
        try:
            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            payload = pickle.dumps((blob, in_tree, out_tree))
        except Exception as e:
            log.debug("executable not stored: %s", e)
            return
        os.makedirs(self.folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, os.path.join(self.folder, key))

"""Which way a Pallas kernel runs: compiled for the GPU, or interpreted elsewhere."""

from __future__ import annotations

import os

import jax


def interpret_mode() -> bool:
    """True unless the default backend is a GPU: kernels lower through Triton only there."""
    return jax.default_backend() != "gpu"


def one_gpu() -> bool:
    """Where the layers call their single-device Pallas kernels: one GPU. Under a mesh XLA's ops
    stay, since they partition the sharded operands and a Pallas call does not."""
    return jax.default_backend() == "gpu" and jax.device_count() == 1


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The setting in environment variable `name` (`default` when unset), one of `choices`: the
    layers' switches between XLA's ops and a kernel, read when a step is traced. Anything else
    is refused by name."""
    value = os.environ.get(name, default)
    if value not in choices:
        expected = " or ".join(filter(None, [", ".join(map(repr, choices[:-1])), repr(choices[-1])]))
        raise ValueError(f"{name}={value!r}: expected {expected}")
    return value


def resolve_interpret(interpret: bool | None) -> bool:
    # None means "from the backend"; an explicit bool is for tests that lower for
    # CUDA on a CPU-only machine.
    return interpret_mode() if interpret is None else bool(interpret)

"""The residual add and the RMSNorm after it: XLA's ops, or one Pallas kernel on the GPU.

XLA emits add-then-norm as several kernels on the GPU (kernels/rms_norm.py says why that
matters at decode batch sizes), so every add-then-norm of a single-GPU step goes through
kernels/rms_norm.py; `JSPEC_ADD_RMS_NORM=xla` keeps XLA's ops (read when a step is traced, so
set per process). Under a mesh XLA's ops stay: a Pallas call does not partition. Off the GPU
the reference runs (the kernel would be interpreted).
"""

from __future__ import annotations

import os

import jax

from jspec.kernels.rms_norm import add_rms_norm as add_rms_norm_kernel
from jspec.kernels.rms_norm import add_rms_norm_ref, rms_norm

ADD_RMS_NORM_ENV = "JSPEC_ADD_RMS_NORM"

__all__ = ["add_rms_norm", "add_rms_norm_backend", "rms_norm"]


def add_rms_norm_backend() -> str:
    value = os.environ.get(ADD_RMS_NORM_ENV, "pallas")
    if value not in ("xla", "pallas"):
        raise ValueError(f"{ADD_RMS_NORM_ENV}={value!r}: expected 'xla' or 'pallas'")
    return value


def add_rms_norm(x: jax.Array, y: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(x + y, rms_norm(x + y, weight)): the new residual stream and the next sublayer's input."""
    if (
        add_rms_norm_backend() == "pallas"
        and jax.default_backend() == "gpu"
        and jax.device_count() == 1
        and x.ndim == 2
        and x.shape == y.shape
    ):
        return add_rms_norm_kernel(x, y, weight, eps=eps)
    return add_rms_norm_ref(x, y, weight, eps)

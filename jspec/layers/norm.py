"""The residual add and the RMSNorm after it: XLA's ops, or one Pallas kernel on the GPU.

XLA emits add-then-norm as several kernels on the GPU (kernels/rms_norm.py says why that
matters at decode batch sizes), so every add-then-norm of a single-GPU step goes through
kernels/rms_norm.py (Pallas over Triton); `JSPEC_ADD_RMS_NORM=xla` keeps XLA's ops, `mosaic`
runs kernels/rms_norm_mgpu.py (Pallas over Mosaic GPU) where it covers the width and the
Triton-backend kernel elsewhere (read when a step is traced, so set per process). Under a mesh
XLA's ops stay: a Pallas call does not partition. Off the GPU the reference runs (the kernel
would be interpreted). Pallas cannot differentiate a kernel that reads its program id, so the
trainers' gradients through a kernel's add-and-norm are the reference's.
"""

from __future__ import annotations

import functools
import logging

import jax

from jspec.kernels.backend import env_choice, one_gpu
from jspec.kernels.rms_norm import add_rms_norm as add_rms_norm_kernel
from jspec.kernels.rms_norm import add_rms_norm_ref, rms_norm
from jspec.kernels.rms_norm_mgpu import add_rms_norm_mgpu, mosaic_add_rms_norm_unsupported

ADD_RMS_NORM_ENV = "JSPEC_ADD_RMS_NORM"
log = logging.getLogger("jspec.layers")

__all__ = ["add_rms_norm", "add_rms_norm_backend", "rms_norm"]


def add_rms_norm_backend(attention_backend: str | None = None) -> str:
    """JSPEC_ADD_RMS_NORM, or when it is unset the attention's kernel family: Mosaic GPU's
    under the Mosaic attention, so that such a program holds no Triton-backend kernel, else
    the Triton-backend one."""
    default = "mosaic" if attention_backend == "mosaic" else "pallas"
    return env_choice(ADD_RMS_NORM_ENV, default, ("xla", "pallas", "mosaic"))


def add_rms_norm(
    x: jax.Array, y: jax.Array, weight: jax.Array, eps: float, attention_backend: str | None = None
) -> tuple[jax.Array, jax.Array]:
    """(x + y, rms_norm(x + y, weight)): the new residual stream and the next sublayer's input;
    attention_backend (the step's AttentionMode.backend) picks the kernel family."""
    backend = add_rms_norm_backend(attention_backend)
    if backend == "xla" or not one_gpu() or x.ndim != 2 or x.shape != y.shape:
        return add_rms_norm_ref(x, y, weight, eps)
    if backend == "mosaic":
        feature = mosaic_add_rms_norm_unsupported(x.shape[1], x.dtype, y.dtype, weight.dtype)
        if feature is None:
            return with_reference_vjp(add_rms_norm_mgpu, x, y, weight, eps)
        _log_triton_fallback(feature)
    return with_reference_vjp(add_rms_norm_kernel, x, y, weight, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def with_reference_vjp(kernel, x, y, weight, eps):
    """kernel(x, y, weight, eps=eps), differentiated as add_rms_norm_ref."""
    return kernel(x, y, weight, eps=eps)


def _kernel_forward(kernel, x, y, weight, eps):
    return kernel(x, y, weight, eps=eps), (x, y, weight)


def _reference_backward(kernel, eps, inputs, cotangents):
    _, vjp = jax.vjp(lambda x, y, w: add_rms_norm_ref(x, y, w, eps), *inputs)
    return vjp(cotangents)


with_reference_vjp.defvjp(_kernel_forward, _reference_backward)


@functools.cache
def _log_triton_fallback(feature: str) -> None:
    log.info("add-and-norm: the Mosaic GPU kernel lacks %s; the Triton-backend kernel runs", feature)

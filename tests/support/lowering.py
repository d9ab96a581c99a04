"""Lowering for CUDA on a CPU-only machine: an abstract H200 to trace against.

Interpret mode hides Triton lowering errors, so every device step also gets lowered with
interpret=False for this device (see tests/kernels/test_kernels_lowering.py for what that reaches)."""

import contextlib

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

H200 = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def on_h200() -> contextlib.AbstractContextManager:
    """A context in which tracing sees one abstract H200."""
    return use_abstract_mesh(AbstractMesh((), (), abstract_device=H200))


def lower_for_cuda(fn, *specs):
    """fn (jitted here unless it is already) traced at specs and lowered for CUDA."""
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    with on_h200():
        return jitted.trace(*specs).lower(lowering_platforms=("cuda",))

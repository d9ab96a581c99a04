"""Lowering for CUDA on a CPU-only machine: an abstract H200 to trace against.

Interpret mode hides Triton lowering errors, so every device step also gets lowered with
interpret=False for this device (see tests/kernels/test_kernels_lowering.py for what that reaches)."""

import contextlib

import jax
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as triton_dialect
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


def _ops(op, name):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                if inner.operation.name == name:
                    yield inner.operation
                yield from _ops(inner.operation, name)


def triton_dots(lowered) -> list[tuple[str, str]]:
    """(input precision, operand type) of every tt.dot in the Triton kernels of a lowered program,
    e.g. ("TF32", "f32"): the precision Triton gives the dot's float32 operands (IEEE: true f32)."""
    dots = []
    for call in _ops(lowered.compiler_ir().operation, "stablehlo.custom_call"):
        config = call.attributes["mhlo.backend_config"] if "mhlo.backend_config" in call.attributes else None
        if config is None or "ir" not in config:
            continue
        context = mlir.make_ir_context()
        triton_dialect.register_dialect(context)
        with context:
            kernel = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            for dot in _ops(kernel.operation, "tt.dot"):
                precision = triton_dialect.InputPrecision(ir.IntegerAttr(dot.attributes["inputPrecision"]).value)
                operand = str(ir.RankedTensorType(dot.operands[0].type).element_type)
                dots.append((precision.name, operand))
    return dots

"""What a result owes its reference on this backend: the test side of the precision contract
(docs/design-details.md, "Precision").

The references pin their dots at HIGHEST, so they are float32 on every backend. A kernel's dots
(and XLA's FP8 dot) name no precision and take JAX's default: float32 on the CPU, TF32 on the GPU
(each float32 operand rounded to 10 mantissa bits), unless jax_default_matmul_precision asks for
more. bf16 operands multiply exactly either way. So a float32 comparison's tolerance follows the
backend and that setting, a bf16 one does not:

    tol = tolerance()                     # a float32 kernel against its reference
    assert rel_err(out, ref) < tol.rel
    np.testing.assert_allclose(out, ref, rtol=tol.rtol, atol=tol.atol)

`JSPEC_EMULATE_TF32=1 pytest tests/kernels` runs the kernel tests on the CPU as the GPU rounds
(emulate_tf32_dots, applied for the session by tests/conftest.py), with the GPU's tolerances.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from jspec.worker import executables


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rel: float  # ||out - ref|| / ||ref||, over the whole result
    rtol: float  # element-wise, as np.testing.assert_allclose's
    atol: float  # element-wise, for values of order one (scale it for larger sums)
    # A log-sum-exp's absolute error (with rtol): its logits' error, however small the lse is.
    lse_atol: float


# Dots in float32: only the summation order and the exp / log roundings differ (~1e-7 each).
EXACT = Tolerance(rel=1e-5, rtol=1e-5, atol=1e-5, lse_atol=0.0)
# Every float32 dot operand rounded to TF32 carries up to 2**-11 of relative error; attention and
# matmul outputs come out ~2e-4..5e-4 off (norm-wise), logits up to ~1e-3. 4 * 2**-11 leaves room
# for a few roundings adding up, and stays far below what a wrong tile, mask or page changes (> 1e-2).
TF32 = Tolerance(rel=2e-3, rtol=2e-3, atol=2e-3, lse_atol=2e-3)
# bf16 inputs and outputs: 8 mantissa bits, on every backend.
BF16 = Tolerance(rel=2e-2, rtol=2e-2, atol=2e-2, lse_atol=2e-2)

# jax_default_matmul_precision settings under which a float32 dot is float32 on the GPU too.
EXACT_SETTINGS = ("highest", "float32", "F32_F32_F32")

_emulating_tf32 = False


def emulating_tf32() -> bool:
    """Whether emulate_tf32_dots is on."""
    return _emulating_tf32


def f32_dots_are_exact() -> bool:
    """Whether a float32 dot that names no precision computes in float32 here: off the GPU, or
    with jax_default_matmul_precision at highest (Pallas' Triton dots follow it too)."""
    if jax.config.jax_default_matmul_precision in EXACT_SETTINGS:
        return True
    return jax.default_backend() != "gpu" and not _emulating_tf32


def tolerance(dtype=jnp.float32, *, dots: str = "default") -> Tolerance:
    """The tolerance a result computed in dtype owes its reference on this backend. dots:
    "default" for a result whose float32 dots name no precision (the kernels, XLA's FP8 dot);
    "exact" for one whose dots are exact on every backend, pinned at HIGHEST (the references,
    against an oracle) or multiplying bf16 / FP8 operands."""
    if dots not in ("default", "exact"):
        raise ValueError(f"dots is 'default' or 'exact', got {dots!r}")
    if jnp.dtype(dtype) == jnp.bfloat16:
        return BF16
    return EXACT if dots == "exact" or f32_dots_are_exact() else TF32


def tf32(x: jax.Array) -> jax.Array:
    """x rounded to TF32 if float32 (10 mantissa bits, to nearest, ties away from zero: what the
    GPU's dots do to float32 operands), else x as it is."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return x
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)


@contextlib.contextmanager
def emulate_tf32_dots() -> Iterator[None]:
    """Within: every dot that names no precision (lax.dot_general, as the kernels call it, and
    jnp.dot / tensordot / einsum) rounds its float32 operands to TF32 and multiplies them in
    float32, unless jax_default_matmul_precision is highest: the GPU's arithmetic on the CPU.
    tolerance() then answers as on the GPU. Dots that pin a precision are left alone."""
    global _emulating_tf32
    if _emulating_tf32:  # already within one (the session's, say)
        yield
        return

    def rounding(fn, num_operands):
        def dot(*args, precision=None, **kw):
            if precision is not None or jax.config.jax_default_matmul_precision in EXACT_SETTINGS:
                return fn(*args, precision=precision, **kw)
            operands = [tf32(a) for a in args[:num_operands]]
            return fn(*operands, *args[num_operands:], precision=lax.Precision.HIGHEST, **kw)

        return dot

    def einsum_rounding(fn):
        def einsum(subscripts, *operands, precision=None, **kw):
            if precision is not None or jax.config.jax_default_matmul_precision in EXACT_SETTINGS:
                return fn(subscripts, *operands, precision=precision, **kw)
            return fn(subscripts, *map(tf32, operands), precision=lax.Precision.HIGHEST, **kw)

        return einsum

    patched = [
        (lax, "dot_general", rounding(lax.dot_general, 2)),
        (jnp, "dot", rounding(jnp.dot, 2)),
        (jnp, "tensordot", rounding(jnp.tensordot, 2)),
        (jnp, "einsum", einsum_rounding(jnp.einsum)),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patched]
    # Programs traced before must not serve calls within, nor those traced within calls after;
    # nor may stored executables, which were traced without the patch.
    jax.clear_caches()
    for module, name, fn in patched:
        setattr(module, name, fn)
    _emulating_tf32, executables.ENABLED = True, False
    try:
        yield
    finally:
        _emulating_tf32, executables.ENABLED = False, True
        for module, name, fn in originals:
            setattr(module, name, fn)
        jax.clear_caches()

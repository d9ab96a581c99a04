"""Random model weights: the one initialiser behind dummy loads, tests' tiny checkpoints and
benchmarks.

Weights are N(0, std), std a number or a function of the tensor's name and shape; every
tensor whose name holds "norm" is a norm scale, 1 + N(0, 0.1), so a wrong norm axis or a
skipped norm changes the output. The draw runs on the device: one jitted program for a small
model, one per distinct tensor shape for a large one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Below this many values one flat draw is sliced into tensors: XLA:CPU compiles a threefry draw
# slowly per distinct shape, and tests make tiny models often. Above it, tensors are drawn one
# by one, each by a program of its shape alone, so no flat f32 buffer the size of the model is
# ever allocated and a model's many layers share a handful of compiled draws (one program
# holding every tensor's draw took a minute to compile for an 8B model on a GPU).
_FLAT_DRAW_LIMIT = 1 << 24


def random_weights(
    shapes, key: jax.Array, dtype: Any = jnp.float32, std: float | Callable[[str, tuple[int, ...]], float] = 0.02
):
    """shapes: a pytree whose leaves are shape tuples (dict keys name the tensors) -> the same
    pytree of random arrays of dtype."""
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    leaves = tuple((jax.tree_util.keystr(path), tuple(shape)) for path, shape in flat)
    scales = tuple(
        1.0 if "norm" in name else float(std(name, shape) if callable(std) else std) for name, shape in leaves
    )
    dtype = np.dtype(jnp.dtype(dtype))
    if sum(math.prod(shape) for _, shape in leaves) <= _FLAT_DRAW_LIMIT:
        arrays = _draw_flat(leaves, scales, key, dtype)
    else:
        keys = jax.random.split(key, len(leaves))
        arrays = [
            _draw_one(shape, std, "norm" in name, dtype, k) for (name, shape), std, k in zip(leaves, scales, keys)
        ]
    return jax.tree.unflatten(treedef, arrays)


def _scaled(noise, std: float, is_norm: bool, dtype):
    # XLA fuses each draw with its scale and cast: no f32 copy of a large tensor is kept.
    return (1.0 + 0.1 * noise if is_norm else std * noise).astype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 3))
def _draw_flat(leaves, scales, key, dtype):
    sizes = [math.prod(shape) for _, shape in leaves]
    pieces = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32), np.cumsum(sizes)[:-1])
    return [
        _scaled(noise.reshape(shape), std, "norm" in name, dtype)
        for (name, shape), std, noise in zip(leaves, scales, pieces)
    ]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _draw_one(shape, std, is_norm, dtype, key):
    return _scaled(jax.random.normal(key, (math.prod(shape),), jnp.float32).reshape(shape), std, is_norm, dtype)

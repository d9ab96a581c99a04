"""Random model weights: the one initialiser behind dummy loads, tests' tiny checkpoints and
benchmarks.

Weights are N(0, std), std a number or a function of the tensor's name and shape; every
tensor whose name holds "norm" is a norm scale, 1 + N(0, 0.1), so a wrong norm axis or a
skipped norm changes the output. The draw is one jitted program on the device.
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
# by one, so no flat f32 buffer the size of the model is ever allocated.
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
    return jax.tree.unflatten(treedef, _draw(leaves, scales, key, np.dtype(jnp.dtype(dtype))))


@functools.partial(jax.jit, static_argnums=(0, 1, 3))
def _draw(leaves, scales, key, dtype):
    sizes = [math.prod(shape) for _, shape in leaves]
    if sum(sizes) <= _FLAT_DRAW_LIMIT:
        pieces = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32), np.cumsum(sizes)[:-1])
    else:
        pieces = [jax.random.normal(k, (n,), jnp.float32) for k, n in zip(jax.random.split(key, len(sizes)), sizes)]
    out = []
    for (name, shape), std, noise in zip(leaves, scales, pieces):
        noise = noise.reshape(shape)
        # XLA fuses each draw with its scale and cast: no f32 copy of a large tensor is kept.
        out.append((1.0 + 0.1 * noise if "norm" in name else std * noise).astype(dtype))
    return out

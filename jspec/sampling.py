"""Token sampling on the device: greedy and temperature sampling, row by row.

Rows with temperature 0 take the argmax, so greedy and sampled requests share
one batch and one compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    """logits [N, V] float32, temperature [N] float32 (0 = greedy), key: one PRNG key -> [N] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    keys = jax.random.split(key, logits.shape[0])
    sampled = jax.vmap(jax.random.categorical)(keys, logits / safe_t).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)

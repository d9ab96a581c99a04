"""jspec's logits through the paged KV path, and the error measure the parity tests bound."""

import functools

import jax
import numpy as np

from jspec.models.forward import forward


@functools.partial(jax.jit, static_argnames=("cfg", "mode"))
def forward_logits(params, kv, batch, *, cfg, mode):
    return forward(params, cfg, kv, batch, mode)


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))

"""Abstract arguments of one speculative iteration (speculative/steps.py's spec_decode_step), for
tests that compile or lower it without running it: shapes only, nothing allocated."""

import jax
import jax.numpy as jnp

from jspec.kvcache.pool import create_kv_pool
from jspec.layers.penalties import init_penalty_state
from jspec.layers.sampling import sampling_rows
from jspec.speculative.method import init_spec_state


def shapes_of(tree, dtype=None):
    """tree's arrays as ShapeDtypeStructs, the floating ones cast to dtype (if given)."""

    def shape(a):
        floating = jnp.issubdtype(a.dtype, jnp.floating)
        return jax.ShapeDtypeStruct(a.shape, dtype if dtype is not None and floating else a.dtype)

    return jax.tree.map(shape, tree)


def iteration_args(method, cfg, target, draft, *, rows: int, pages: int, page_size: int, table_width: int, dtype):
    """(target weights, draft weights, state, slot ids, page tables, sampling rows) for `rows`
    requests over a pool of `pages` pages, the weights and the pool in dtype."""
    state = jax.eval_shape(
        lambda: init_spec_state(
            method,
            create_kv_pool(cfg, pages, page_size, dtype),
            rows,
            pages,
            page_size,
            dtype,
            init_penalty_state(rows, cfg.vocab_size),
        )
    )
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    return (
        shapes_of(target, dtype),
        shapes_of(draft, dtype),
        state,
        ints(rows),
        ints(rows, table_width),
        shapes_of(sampling_rows([], [], rows)),
    )

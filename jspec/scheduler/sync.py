"""The one place where the scheduler reads device values.

The overlap loop (docs/architecture.md, "Host side") launches step N+1, then reads step
N's small outputs, whose device->host copy was started right after N's launch.
That read is the loop's only host<->device sync, and it goes through
`designated_read` so that tests can tell it from an accidental one
(tests/support/sync_guard.py allows reads made inside this function and fails on any
other). Nothing else in the scheduler may call np.asarray, int(), .item(),
jax.device_get or block_until_ready on a device array.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np


def start_host_copy(tree: Any) -> Any:
    """Starts the device->host copy of every jax array in `tree`, without waiting.

    Call it right after launching a step, on that step's outputs; returns `tree`. A CPU
    "device" holds its arrays in host memory already (designated_read views them in place),
    so there it does nothing: each copy would only cost the launch host time.
    """
    if _outputs_on_host():
        return tree
    leaves = jax.tree.leaves(tree)
    # The designated copy: allowed under a "disallow" transfer guard, like designated_read.
    with jax.transfer_guard_device_to_host("allow"):
        for leaf in leaves:
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()
    return tree


@functools.cache
def _outputs_on_host() -> bool:
    """Whether steps run on the CPU backend, whose outputs live in host memory."""
    return jax.default_backend() == "cpu"


def designated_read(tree: Any) -> Any:
    """`tree` with every array leaf as numpy: the loop's one sync point.

    Blocks until the step that made `tree` is done (its copy, started by
    `start_host_copy`, has usually landed by then). On the CPU, np.asarray is a
    zero-copy view of the device buffer: do not donate these arrays afterwards.
    """
    # Allowed here even under jax.transfer_guard_device_to_host("disallow"), which a GPU
    # run of the loop (benchmarks/bench_overlap.py) uses to prove there is no other read.
    with jax.transfer_guard_device_to_host("allow"):
        return jax.tree.map(np.asarray, tree)

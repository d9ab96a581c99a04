"""Multi-host start-up from SGLang's flags: --nnodes, --node-rank, --dist-init-addr.

Every host runs the same command with its own --node-rank; jax.distributed then joins
them into one JAX runtime whose jax.devices() lists every host's accelerators, so the
meshes of jspec.distributed span hosts unchanged. It must run before anything touches a
JAX backend (loading a model does), which is why serve.py calls it first.
"""

from __future__ import annotations

import jax


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr {addr!r}: give HOST:PORT of node 0's coordinator, e.g. 10.0.0.1:5000")
    return host, int(port)


def check_multihost_args(nnodes: int, node_rank: int, dist_init_addr: str | None) -> None:
    if nnodes < 1:
        raise ValueError(f"--nnodes {nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, --nnodes {nnodes})")
    if nnodes > 1 and not dist_init_addr:
        raise ValueError(
            f"--nnodes {nnodes} needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"
        )
    if dist_init_addr:
        parse_dist_init_addr(dist_init_addr)


def init_distributed(nnodes: int = 1, node_rank: int = 0, dist_init_addr: str | None = None) -> bool:
    """Joins this process to an nnodes-process JAX runtime (node 0 hosts the coordinator at
    dist_init_addr). One node: nothing to join, returns False."""
    check_multihost_args(nnodes, node_rank, dist_init_addr)
    if nnodes == 1:
        return False

    jax.distributed.initialize(coordinator_address=dist_init_addr, num_processes=nnodes, process_id=node_rank)
    return True

"""Multi-device execution on jax.sharding meshes: tensor parallelism (tensor_parallel.py)."""

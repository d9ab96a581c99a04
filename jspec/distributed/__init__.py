"""Multi-device execution on jax.sharding meshes: tensor parallelism (tensor_parallel.py), DP attention
(dp_attention.py; its host side: worker/dp.py), multi-host start-up (multihost.py)."""

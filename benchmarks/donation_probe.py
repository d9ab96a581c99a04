"""Does donating the KV pool to a trivial step need a second pool-sized buffer on this device?
Pointers of K and V, then a donated update of both, for the 8B and SmolLM2 shapes."""

import sys

import jax
import jax.numpy as jnp

import jspec
from jspec.kvcache.pool import create_kv_pool

touch_donated = jax.jit(lambda pool: jax.tree.map(lambda x: x.at[0, 0, 0, 0, 0].add(1), pool), donate_argnums=0)

for path, tokens in [(p.split(":")[0], int(p.split(":")[1])) for p in sys.argv[1:]]:
    cfg = jspec.ModelConfig.from_pretrained(path)
    pool = create_kv_pool(cfg, tokens // 16 + 1, 16, jnp.bfloat16)
    same = pool.k.unsafe_buffer_pointer() == pool.v.unsafe_buffer_pointer()
    print(f"{path} {tokens} tokens: K {pool.k.shape} same buffer as V: {same}", flush=True)
    for attempt in range(2):
        try:
            pool = touch_donated(pool)
            jax.block_until_ready(pool)
            print(f"  donated update {attempt}: ok, deleted input: ", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  donated update {attempt}: FAILED {str(e)[:160]}", flush=True)
            break
    print("  in use GiB", jax.devices()[0].memory_stats()["bytes_in_use"] / 2**30, flush=True)
    del pool

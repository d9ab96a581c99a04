"""Absorbed MLA decode (DeepSeek's latent attention) on the GPU: the Pallas kernel against its
jnp reference, time and bandwidth over the latent bytes a call must read.

Each case is a decode batch at DeepSeek-V3's latent shape (kv_lora_rank 512 + RoPE 64, bf16)
with 128 query heads (one GPU) or 16 (a TP-8 shard). The kernel's output is checked against
the reference, then both are timed (median of repeated runs of back-to-back calls). Floor: the
latent bytes read, B x ctx x 576 x 2, over the copy bandwidth measured in this run. Each
case also times the kernel with the default's neighbours for heads per program (block_h 16
and 64, where the heads fill them): a program reads every latent tile of its sequence once,
so at 128 heads and block_h 16 each tile is read 8 times. And the Mosaic GPU kernel
(kernels/mla_decode_mgpu.py: 64 heads per program, the rank in value chunks of 256, each chunk
its own call over the same tiles), where it covers the case; what it does not is recorded by name.
Then a verify of a few chained draft tokens per sequence: the Triton-backend and Mosaic GPU
extend kernels against the reference.

    python -m benchmarks.bench_mla [--dry-run] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import RESULTS_DIR, Results, copy_bandwidth, timed
from jspec.kernels.mgpu_tiles import MosaicUnsupported
from jspec.kernels.mla_decode import mla_decode, mla_extend
from jspec.kernels.mla_decode_mgpu import mla_decode_mgpu, mla_extend_mgpu
from jspec.kernels.mla_ref import mla_decode_ref, mla_extend_ref

# (batch, context, page_size, heads)
CASES = [(1, 4096, 64, 128), (32, 4096, 64, 128), (128, 2048, 64, 16), (32, 4096, 1, 16)]
DRY_CASES = [(2, 64, 16, 16), (3, 40, 1, 16), (1, 32, 16, 64)]
# Verify: (batch, context, page_size, heads, new tokens), each sequence's new tokens a chain tree.
VERIFY_CASES = [(32, 4096, 64, 128, 4), (32, 4096, 64, 16, 8)]
DRY_VERIFY_CASES = [(2, 64, 16, 16, 4)]


def problem(batch, ctx, page_size, heads, rank, rope, dtype, seed=0):
    rng = np.random.default_rng(seed)
    pages = batch * ctx // page_size + 1
    cache = jnp.asarray(rng.standard_normal((1, pages, page_size, 1, rank + rope)), dtype)
    tables = jnp.asarray(1 + rng.permutation(pages - 1).reshape(batch, ctx // page_size), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, heads, rank + rope)), dtype)
    return q, cache, jnp.int32(0), jnp.full((batch,), ctx, jnp.int32), tables


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (the CPU check of the script)")
    ap.add_argument("--out", default=RESULTS_DIR)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    dry = args.dry_run
    rank, rope, dtype = (32, 8, jnp.float32) if dry else (512, 64, jnp.bfloat16)
    cases = DRY_CASES if dry else CASES
    results = Results(args.out, "bench_mla", {"rank": rank, "rope": rope, "dtype": jnp.dtype(dtype).name})
    bandwidth = None if dry else copy_bandwidth()
    rows = []
    iters, repeats = (1, 1) if dry else (args.iters, 5)
    for batch, ctx, page_size, heads in cases:
        q, cache, layer, lens, tables = problem(batch, ctx, page_size, heads, rank, rope, dtype)
        kw = dict(kv_lora_rank=rank, sm_scale=(192.0**-0.5))
        kernel = jax.jit(functools.partial(mla_decode, **kw))
        ref = jax.jit(functools.partial(mla_decode_ref, **kw))
        args = (q, cache, layer, lens, tables)
        out, want = kernel(*args), ref(*args)
        err = rel_error(out, want)
        t_kernel = timed(lambda: kernel(q, cache, layer, lens, tables), iters, repeats)
        t_ref = timed(lambda: ref(q, cache, layer, lens, tables), iters, repeats)
        read = batch * ctx * (rank + rope) * jnp.dtype(dtype).itemsize
        # The default's neighbours for heads per program (where the heads fill them), and Mosaic GPU.
        by_block_h = {
            block_h: time_kernel(functools.partial(mla_decode, block_h=block_h, **kw), args, want, read, iters, repeats)
            for block_h in (16, 64)
            if block_h < heads  # else the default already runs all the heads in one block
        }
        mosaic_row = time_kernel(functools.partial(mla_decode_mgpu, **kw), args, want, read, iters, repeats)
        row = dict(
            batch=batch,
            ctx=ctx,
            page_size=page_size,
            heads=heads,
            rel_err=err,
            kernel_us=t_kernel * 1e6,
            reference_us=t_ref * 1e6,
            latent_bytes=read,
            kernel_gbps=read / t_kernel / 1e9,
            floor_us=None if bandwidth is None else read / bandwidth * 1e6,
            by_block_h=by_block_h,
            mosaic=mosaic_row,
        )
        rows.append(row)
        print(row, flush=True)
        results.write(rows=rows, copy_bandwidth=bandwidth)
    verify_rows = []
    for batch, ctx, page_size, heads, new in DRY_VERIFY_CASES if dry else VERIFY_CASES:
        verify_rows.append(time_verify(batch, ctx, page_size, heads, new, rank, rope, dtype, iters, repeats, bandwidth))
        print(verify_rows[-1], flush=True)
        results.write(rows=rows, verify_rows=verify_rows, copy_bandwidth=bandwidth)
    return rows, verify_rows


def time_kernel(kernel, args, want, read, iters, repeats) -> dict:
    """kernel(*args) checked against want and timed: its time, the read bandwidth over read
    bytes and its error; or the feature it refuses by name, or the error it raised (a kernel
    failing on the GPU is recorded, not fatal)."""
    fn = jax.jit(kernel)
    try:
        err = rel_error(fn(*args), want)
        t = timed(lambda: fn(*args), iters, repeats)
        return dict(kernel_us=t * 1e6, kernel_gbps=read / t / 1e9, rel_err=err)
    except MosaicUnsupported as e:
        return {"unsupported": e.feature}
    except Exception as e:  # noqa: BLE001 - recorded with the row
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def rel_error(got, want) -> float:
    return float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))


def time_verify(batch, ctx, page_size, heads, new, rank, rope, dtype, iters, repeats, bandwidth) -> dict:
    """A verify of `new` chained draft tokens per sequence at the end of ctx cached latents: the
    Triton-backend mla_extend and the Mosaic GPU one against the reference, timed. Each new token
    reads its sequence's latent once per program, so the floor is new x the decode's bytes."""
    q, cache, layer, lens, tables = problem(batch, ctx, page_size, heads, rank, rope, dtype)
    q = jnp.repeat(q, new, axis=0)  # [B * new, H, W]
    query_start = jnp.arange(batch + 1, dtype=jnp.int32) * new
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((new, new), bool)), (batch, new, new))
    kw = dict(kv_lora_rank=rank, sm_scale=(192.0**-0.5), max_q_len=new, mask=mask)
    args = (q, cache, layer, lens, tables, query_start)
    want = jax.jit(functools.partial(mla_extend_ref, **kw))(*args)
    read = new * batch * ctx * (rank + rope) * jnp.dtype(dtype).itemsize
    row = dict(batch=batch, ctx=ctx, page_size=page_size, heads=heads, new_tokens=new, latent_bytes_read=read)
    row["floor_us"] = None if bandwidth is None else read / bandwidth * 1e6
    for name, kernel in (("triton", mla_extend), ("mosaic", mla_extend_mgpu)):
        row[name] = time_kernel(functools.partial(kernel, **kw), args, want, read, iters, repeats)
    return row


if __name__ == "__main__":
    main()

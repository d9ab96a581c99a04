"""Paged attention for decode: one query token per sequence, Pallas over Triton.

Grid (sequence, kv head, context split). One program holds the whole GQA group
of query heads that share its kv head, so every KV row is read from HBM once;
the group is padded to >= 16 rows because Triton's tl.dot needs M >= 16. The
context is split (split-K) so that a small batch still fills the GPU; the
partial (max, sum, acc) of the splits are merged in jnp, which costs
B * splits * Hq * D * 4 bytes against the B * ctx * Hkv * D * 4 of KV read.

The number of splits is static (sized for the widest context the page table
can address), their length is not: it comes from the batch's longest sequence,
so work follows the real lengths whatever the table width.

A sliding window (a runtime int32, so layers of different windows share one
program) hides keys window or more positions behind the query: each sequence's
splits then cover only its last window tokens.

Attention sinks (gpt-oss) enter as the initial online-softmax state of the first
split: running max the sink logit, normaliser 1, so the merge counts them once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.kernels.backend import resolve_interpret
from jspec.kernels.paged_tiles import (
    LOG2E,
    attend_tile,
    cache_rows,
    check_pow2,
    choose_splits,
    gather_kv_tiles,
    initial_state,
    kv_compute_dtype,
    lse_of_splits,
    merge_splits,
    min_split_len,
    next_pow2,
    normalise,
    runtime_split_len,
    window_scalar,
    with_sink,
)


def _decode_kernel(
    layer_window_ref,
    split_len_ref,
    seq_lens_ref,
    page_tables_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    cache_shape,
    group,
    group_rows,
    block_n,
    scale_log2,
    softcap,
    sinks,
    write_final,
):
    if sinks:
        sinks_ref, *out_refs = refs
    else:
        out_refs = refs
    seq, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[2]
    layer, window = layer_window_ref[0], layer_window_ref[1]
    split_len = split_len_ref[0]
    kv_len = jnp.minimum(seq_lens_ref[seq], page_tables_ref.shape[1] * cache_shape[2])
    # The query sits at kv_len - 1: keys before kv_len - window are out of its window.
    lo = jnp.maximum(kv_len - window, 0) + split * split_len
    hi = jnp.minimum(lo + split_len, kv_len)
    num_tokens = jnp.maximum(hi - lo, 0)

    rows = lax.iota(jnp.int32, group_rows)
    real_row = rows < group
    heads = (kv_head * group + rows)[:, None]
    cols = lax.iota(jnp.int32, head_dim)[None, :]
    q = pltriton.load(q_ref.at[seq, heads, cols], mask=real_row[:, None], other=0).astype(
        kv_compute_dtype(k_ref.dtype, q_ref.dtype)
    )
    tiles = functools.partial(
        gather_kv_tiles,
        k_ref,
        v_ref,
        page_tables_ref,
        cache_shape=cache_shape,
        layer=layer,
        seq=seq,
        kv_head=kv_head,
        block_n=block_n,
    )

    def full_tile(i, carry):
        k, v = tiles(start=lo + i * block_n)
        return attend_tile(q, k, v, *carry, scale_log2=scale_log2, softcap=softcap)

    num_full = num_tokens // block_n
    tail_start = lo + num_full * block_n

    def tail_tile(_, carry):
        # Only the sequence's last tile is partial: mask it, and only it.
        k, v = tiles(start=tail_start, valid_len=hi)
        visible = (tail_start + lax.iota(jnp.int32, block_n) < hi)[None, :]
        return attend_tile(q, k, v, *carry, scale_log2=scale_log2, visible=visible, softcap=softcap)

    carry = initial_state(group_rows, head_dim)
    if sinks:
        sink = pltriton.load(sinks_ref.at[heads[:, 0]], mask=real_row, other=0)
        carry = with_sink(carry, sink, first_split=split == 0)
    carry = lax.fori_loop(0, num_full, full_tile, carry)
    carry = lax.fori_loop(0, (num_tokens > num_full * block_n).astype(jnp.int32), tail_tile, carry)
    m, l, acc = carry

    if write_final:
        (out_ref,) = out_refs
        out = normalise(acc, l).astype(out_ref.dtype)
        pltriton.store(out_ref.at[seq, heads, cols], out, mask=real_row[:, None])
    else:
        acc_ref, m_ref, l_ref = out_refs
        pltriton.store(acc_ref.at[seq, split, heads, cols], acc, mask=real_row[:, None])
        pltriton.store(m_ref.at[seq, split, heads[:, 0]], m, mask=real_row)
        pltriton.store(l_ref.at[seq, split, heads[:, 0]], l, mask=real_row)


class DecodePlan(NamedTuple):
    """Static launch settings, resolved from shapes and the tuning arguments."""

    block_n: int  # KV tokens per tile
    group_rows: int  # GQA group padded to a power of two >= 16
    num_splits: int
    min_split_len: int  # floor of the runtime KV tokens per split, a multiple of block_n
    num_warps: int
    num_stages: int


def decode_plan(
    batch,
    num_q_heads,
    cache_shape,
    max_pages,
    *,
    block_n=None,
    num_splits=None,
    min_split_tokens=256,
    num_warps=4,
    num_stages=2,
) -> DecodePlan:
    _, _, page_size, num_kv_heads, head_dim = cache_shape
    check_pow2("page_size", page_size)
    check_pow2("head_dim", head_dim)
    # 64 x 128 bf16 = 16 KiB per K/V tile: enough bytes in flight per iteration
    # without crowding out a second resident program per SM.
    block_n = block_n or (64 if head_dim >= 128 else 128)
    check_pow2("block_n", block_n)
    group = num_q_heads // num_kv_heads
    splits, _ = choose_splits(max_pages * page_size, batch * num_kv_heads, block_n, min_split_tokens, num_splits)
    return DecodePlan(
        block_n,
        next_pow2(max(group, 16)),
        splits,
        min_split_len(block_n, min_split_tokens, num_splits),
        num_warps,
        num_stages,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "logit_softcap",
        "interpret",
        "block_n",
        "num_splits",
        "min_split_tokens",
        "num_warps",
        "num_stages",
        "return_lse",
    ),
)
def paged_decode(
    q,
    k_cache,
    v_cache,
    layer,
    seq_lens,
    page_tables,
    *,
    sm_scale,
    interpret=None,
    block_n=None,
    num_splits=None,
    min_split_tokens=256,
    num_warps=4,
    num_stages=2,
    return_lse=False,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """Attention of one new token per sequence over its paged KV.

    q [B, Hq, D]; k_cache, v_cache [L, P, S, Hkv, D]; layer int32 () or (1,);
    seq_lens [B] int32 (valid KV tokens, 0 gives zeros); page_tables [B, max_pages]
    int32. Returns [B, Hq, D] in q's dtype. Softmax in f32; q is cast to the
    cache dtype for the matmuls. With return_lse: (out [B, Hq, D] f32, the
    natural-log log-sum-exp of the scaled logits [B, Hq] f32, -inf for seq_len 0),
    so callers can merge this attention with one over keys outside the pool.
    window: None, or an int32 () array: the query (at position seq_len - 1) sees
    only the last window keys (HF's sliding_window; >= 1).
    logit_softcap: None, or c: the scaled logits become c * tanh(logits / c) (Gemma 2).
    sinks: None, or f32 [Hq]: each head's learned sink logit joins its softmax's denominator
    (a key of value zero: gpt-oss); the lse then counts it too.

    Tuning (see decode_plan): block_n tokens per KV tile (power of two, any
    page size); num_splits context partitions (None: from B and Hkv, no more
    than keep a split of the table's whole width min_split_tokens long). At
    run time the longest sequence is spread evenly over the splits, each at
    least min_split_tokens long unless num_splits is given. num_warps and
    num_stages go to Triton.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    if k_cache.shape[4] != head_dim or num_q_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {q.shape} does not fit the caches {k_cache.shape}, {v_cache.shape}")
    plan = decode_plan(
        batch,
        num_q_heads,
        k_cache.shape,
        page_tables.shape[1],
        block_n=block_n,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    group = num_q_heads // num_kv_heads
    # The partials (max, sum, acc) carry the log-sum-exp, so asking for it takes the split path.
    write_final = plan.num_splits == 1 and not return_lse
    kernel = functools.partial(
        _decode_kernel,
        cache_shape=k_cache.shape,
        group=group,
        group_rows=plan.group_rows,
        block_n=plan.block_n,
        scale_log2=float(sm_scale) * LOG2E,
        softcap=None if logit_softcap is None else float(logit_softcap),
        sinks=sinks is not None,
        write_final=write_final,
    )
    kv_lens = jnp.minimum(seq_lens.astype(jnp.int32), page_tables.shape[1] * k_cache.shape[2])
    window = window_scalar(window)
    split_len = runtime_split_len(jnp.minimum(kv_lens, window), plan.num_splits, plan.block_n, plan.min_split_len)
    if write_final:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        partial = (batch, plan.num_splits, num_q_heads)
        out_shape = [
            jax.ShapeDtypeStruct((*partial, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
        ]
    extra = () if sinks is None else (sinks.astype(jnp.float32),)
    outs = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, plan.num_splits),
        out_shape=out_shape,
        interpret=resolve_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        name=f"paged_decode_s{k_cache.shape[2]}_g{group}_n{plan.block_n}",
    )(
        jnp.stack([jnp.reshape(layer, ()).astype(jnp.int32), window]),
        split_len,
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        q,
        cache_rows(k_cache),
        cache_rows(v_cache),
        *extra,
    )
    if write_final:
        return outs[0]
    acc, m, l = outs
    if return_lse:
        return merge_splits(acc, m, l, axis=1), lse_of_splits(m, l, axis=1)
    return merge_splits(acc, m, l, axis=1).astype(q.dtype)

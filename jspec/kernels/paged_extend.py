"""Paged attention for a ragged batch of new tokens (prefill chunks, tree verification).

Grid (query block, context split, kv head), over the batch's query blocks
themselves: a table built before the launch maps each program to its sequence
and block, so a prefill of a few long prompts among many one-token rows (a mixed
step) launches programs for the blocks that exist, not batch x the longest
query's blocks. The table's static length is the fewer of batch x max blocks and
the rows' blocks plus one partial block per sequence; entries past the real
blocks do nothing. A query block's rows are (token, head) pairs: block_m // G
consecutive new tokens of one sequence times the G query heads sharing the
program's kv head, so a short query (a draft tree of 8 tokens) still fills an
MMA tile and each KV row is read once per block. Rows are gathered from the flat
ragged q by offset and mask.

Masking is causal by default; with a tree mask the KV prefix is fully visible
and new token i sees new token k iff mask[b, i, k]. Tiles wholly below the
mask's reach skip masking, so a long prefill pays for it only near the diagonal.

As in paged_decode, the number of context splits is static and their length
comes from the batch's longest sequence, so the page-table width costs nothing.

A sliding window (a runtime int32) hides keys window or more positions behind
a query. A query block then reads from its first token's window start on; the
tiles below the block's last token's window start are masked as well.
A tree node's position is the prefix plus its depth in the tree (its count of
ancestors in the mask); the window applies to the prefix, and a node sees all
its ancestors (callers keep trees shallower than the window).

Attention sinks (gpt-oss) start the first split's online softmax, as in paged_decode.
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
    NUM_SMS,
    TARGET_PROGRAMS,
    attend_tile,
    cache_rows,
    check_pow2,
    choose_splits,
    gather_kv_tiles,
    initial_state,
    kv_compute_dtype,
    largest_pow2_upto,
    merge_splits,
    min_split_len,
    next_pow2,
    normalise,
    query_block_count,
    query_block_table,
    runtime_split_len,
    tree_depth,
    window_scalar,
    with_sink,
)


def _extend_kernel(
    layer_window_ref,
    split_len_ref,
    block_seq_ref,
    block_index_ref,
    seq_lens_ref,
    page_tables_ref,
    query_start_ref,
    q_ref,
    k_ref,
    v_ref,
    *refs,
    cache_shape,
    group,
    block_m,
    block_n,
    splits,
    scale_log2,
    softcap,
    tree,
    sinks,
    write_final,
):
    if tree:
        tree_mask_ref, depth_ref, *refs = refs
    if sinks:
        sinks_ref, *refs = refs
    if write_final:
        _zeros_ref, out_ref = refs  # the output aliases the zeros input
    else:
        acc_ref, m_ref, l_ref = refs
    item, split, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    real_seq, q_block = block_seq_ref[item], block_index_ref[item]  # -1: past the real blocks
    seq = jnp.maximum(real_seq, 0)
    tokens_per_block = block_m // group
    row0 = query_start_ref[seq]
    q_len = query_start_ref[seq + 1] - row0
    first = q_block * tokens_per_block  # first new token of this block, within its sequence

    @pl.when((real_seq >= 0) & (first < q_len))
    def _():
        head_dim = q_ref.shape[2]
        layer, window = layer_window_ref[0], layer_window_ref[1]
        kv_len = jnp.minimum(seq_lens_ref[seq], page_tables_ref.shape[1] * cache_shape[2])
        prefix = kv_len - q_len  # KV entries before the new tokens
        last = jnp.minimum(first + tokens_per_block, q_len) - 1

        rows = lax.iota(jnp.int32, block_m)
        token = first + lax.div(rows, group)  # new-token index of each row
        real_row = (rows < tokens_per_block * group) & (token < q_len)
        flat_row = (row0 + token)[:, None]
        head = (kv_head * group + lax.rem(rows, group))[:, None]
        cols = lax.iota(jnp.int32, head_dim)[None, :]
        q = pltriton.load(q_ref.at[flat_row, head, cols], mask=real_row[:, None], other=0).astype(
            kv_compute_dtype(k_ref.dtype, q_ref.dtype)
        )
        # Each row's position in the sequence, and the first key its window holds.
        if tree:
            depth = pltriton.load(depth_ref.at[seq, token], mask=real_row, other=0)
            row_pos = prefix + depth
        else:
            row_pos = prefix + token
        window_start = jnp.maximum(row_pos - window + 1, 0)[:, None]
        # Keys every row's window holds start at the block's highest window start.
        lowest = jnp.min(jnp.where(real_row, window_start[:, 0], kv_len))
        highest = jnp.max(jnp.where(real_row, window_start[:, 0], 0))

        split_len = split_len_ref[0]
        lo = lowest + split * split_len
        # Causal: nothing past the block's last token; tree: every new token may be visible.
        reach = kv_len if tree else jnp.minimum(kv_len, prefix + last + 1)
        hi = jnp.minimum(lo + split_len, reach)
        # Positions every row sees: the prefix (tree) or up to the block's first token (causal).
        unmasked_end = prefix if tree else prefix + first + 1
        # Tiles below the highest window start are masked, then whole tiles every row sees,
        # then masked tiles up to hi.
        num_low = lax.div(jnp.maximum(jnp.minimum(highest, hi) - lo, 0) + block_n - 1, block_n)
        full_start = lo + num_low * block_n
        num_full = jnp.maximum(jnp.minimum(unmasked_end, hi) - full_start, 0) // block_n
        masked_start = full_start + num_full * block_n
        num_masked = lax.div(jnp.maximum(hi - masked_start, 0) + block_n - 1, block_n)
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
            k, v = tiles(start=full_start + i * block_n)
            return attend_tile(q, k, v, *carry, scale_log2=scale_log2, softcap=softcap)

        def masked_tile(i, carry, first_tile):
            start = first_tile + i * block_n
            k, v = tiles(start=start, valid_len=hi)
            kv_pos = (start + lax.iota(jnp.int32, block_n))[None, :]
            if tree:
                new_index = kv_pos - prefix
                is_new = (new_index >= 0) & (kv_pos < hi)
                allowed = pltriton.load(
                    tree_mask_ref.at[seq, token[:, None], new_index], mask=is_new & real_row[:, None], other=0
                )
                visible = (kv_pos < hi) & ((new_index < 0) | (allowed != 0))
            else:
                visible = (kv_pos < hi) & (kv_pos <= prefix + token[:, None])
            visible &= kv_pos >= window_start
            return attend_tile(q, k, v, *carry, scale_log2=scale_log2, visible=visible, softcap=softcap)

        carry = initial_state(block_m, head_dim)
        if sinks:
            sink = pltriton.load(sinks_ref.at[head[:, 0]], mask=real_row, other=0)
            carry = with_sink(carry, sink, first_split=split == 0)
        carry = lax.fori_loop(0, num_low, functools.partial(masked_tile, first_tile=lo), carry)
        carry = lax.fori_loop(0, num_full, full_tile, carry)
        m, l, acc = lax.fori_loop(0, num_masked, functools.partial(masked_tile, first_tile=masked_start), carry)

        if write_final:
            out = normalise(acc, l).astype(out_ref.dtype)
            pltriton.store(out_ref.at[flat_row, head, cols], out, mask=real_row[:, None])
        else:
            pltriton.store(acc_ref.at[split, flat_row, head, cols], acc, mask=real_row[:, None])
            pltriton.store(m_ref.at[split, flat_row[:, 0], head[:, 0]], m, mask=real_row)
            pltriton.store(l_ref.at[split, flat_row[:, 0], head[:, 0]], l, mask=real_row)


class ExtendPlan(NamedTuple):
    """Static launch settings, resolved from shapes and the tuning arguments."""

    block_m: int  # rows (new tokens x GQA heads) per query block
    block_n: int  # KV tokens per tile
    num_q_blocks: int  # of the longest query
    num_items: int  # query blocks the grid holds: enough for any ragged batch of these shapes
    num_splits: int
    min_split_len: int  # floor of the runtime KV tokens per split, a multiple of block_n
    num_warps: int
    num_stages: int


def extend_plan(
    batch,
    num_q_heads,
    cache_shape,
    max_pages,
    max_q_len,
    num_rows=None,
    *,
    block_m=None,
    block_n=None,
    num_splits=None,
    min_split_tokens=None,
    num_warps=None,
    num_stages=2,
) -> ExtendPlan:
    """Long prefill (128 rows or more) gets 128-row blocks and 8 warps (the usual Hopper
    flash-attention shape). Short queries (tree / chain verification) put enough programs
    first: from the smallest MMA-able block that holds every row, the block halves (down to
    16 rows, never below the GQA group) while the halved blocks x kv heads still fit one wave
    of SMs. Within a wave a smaller block only shortens each program (fewer rows per KV tile);
    past it the extra blocks re-read the KV. A grid that small also lets a context split be
    one KV tile long (min_split_tokens None), so a short context still spreads over enough
    splits to fill the GPU, though never past the target grid of programs, since the split
    count follows the table's width and idle splits cost; otherwise splits keep at least 256
    tokens. Explicit arguments win."""
    _, _, page_size, num_kv_heads, head_dim = cache_shape
    check_pow2("page_size", page_size)
    check_pow2("head_dim", head_dim)
    group = num_q_heads // num_kv_heads
    rows = max_q_len * group
    short = rows < 128
    block_n = block_n or (64 if head_dim >= 128 else 128)
    check_pow2("block_n", block_n)

    def items(m):
        tokens = m // group
        return query_block_count(batch, -(-max_q_len // tokens), tokens, num_rows)

    smallest = max(16, next_pow2(group))
    if block_m is None:
        block_m = max(next_pow2(rows), smallest) if short else 128
        while short and block_m > smallest and items(block_m // 2) * num_kv_heads <= NUM_SMS:
            block_m //= 2
    block_m = max(block_m, next_pow2(group))
    check_pow2("block_m", block_m)
    num_q_blocks = -(-max_q_len // (block_m // group))
    num_items = items(block_m)
    programs = num_items * num_kv_heads
    one_wave = short and programs <= NUM_SMS
    if min_split_tokens is None:
        min_split_tokens = block_n if one_wave else 256
    max_kv = max_pages * page_size
    splits, _ = choose_splits(max_kv, programs, block_n, min_split_tokens, num_splits)
    if num_splits is None and one_wave and splits * programs > TARGET_PROGRAMS:
        # The split count is static and follows the page table's width, while a server's
        # sequences mostly hold far less: every split past the runtime context is a program
        # that starts only to find no tile, and waves of those cost as much as a short
        # verify's own work. So a short grid stays under the target rather than rounding past it.
        capped = largest_pow2_upto(TARGET_PROGRAMS // programs)
        splits, _ = choose_splits(max_kv, programs, block_n, min_split_tokens, capped)
    num_warps = num_warps or (8 if block_m >= 128 else 4)
    return ExtendPlan(
        block_m,
        block_n,
        num_q_blocks,
        num_items,
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
        "max_q_len",
        "interpret",
        "block_m",
        "block_n",
        "num_splits",
        "min_split_tokens",
        "num_warps",
        "num_stages",
    ),
)
def paged_extend(
    q,
    k_cache,
    v_cache,
    layer,
    seq_lens,
    page_tables,
    query_start,
    *,
    sm_scale,
    max_q_len,
    mask=None,
    interpret=None,
    block_m=None,
    block_n=None,
    num_splits=None,
    min_split_tokens=None,
    num_warps=None,
    num_stages=2,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """Attention of ragged new tokens over their sequences' paged KV.

    q [T, Hq, D] flat: sequence b's new tokens are rows query_start[b]:query_start[b+1]
    (query_start [B+1] int32, cumulative) and are the last qlen_b of its
    seq_lens[b] KV entries, already written to the cache. max_q_len (static)
    bounds every qlen_b. mask: None (causal) or bool [B, max_q_len, max_q_len]
    (tree: prefix visible, new token i sees new token k iff mask[b, i, k]).
    Returns [T, Hq, D] in q's dtype; rows from query_start[B] on are zeros.
    window: None, or an int32 () array: a query at position p sees keys at
    positions > p - window only (HF's sliding_window). Under a tree mask a
    node's position is prefix + its depth, and the tree must be shallower than
    the window (a node sees all its ancestors).
    logit_softcap: None, or c: the scaled logits become c * tanh(logits / c) (Gemma 2).
    sinks: None, or f32 [Hq]: each head's learned sink logit joins its softmax's denominator
    (gpt-oss).

    Tuning (see extend_plan): block_m rows (tokens x GQA heads) per query
    block, block_n KV tokens per tile (both powers of two); num_splits context
    partitions (None: chosen from the grid size, no more than keep a split of
    the table's whole width min_split_tokens long); at run time the longest
    sequence is spread evenly over them, each at least min_split_tokens long
    unless num_splits is given (min_split_tokens None: 256, or one KV tile for a
    short query whose grid fits one wave, see extend_plan); num_warps,
    num_stages for Triton.
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    batch = seq_lens.shape[0]
    if k_cache.shape[4] != head_dim or num_q_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {q.shape} does not fit the caches {k_cache.shape}, {v_cache.shape}")
    if query_start.shape != (batch + 1,):
        raise ValueError(f"query_start must be [B+1] = [{batch + 1}], got {query_start.shape}")
    if mask is not None and mask.shape != (batch, max_q_len, max_q_len):
        raise ValueError(f"mask must be [B, max_q_len, max_q_len], got {mask.shape}")
    plan = extend_plan(
        batch,
        num_q_heads,
        k_cache.shape,
        page_tables.shape[1],
        max_q_len,
        num_rows,
        block_m=block_m,
        block_n=block_n,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    group = num_q_heads // num_kv_heads
    write_final = plan.num_splits == 1
    tree = mask is not None
    kernel = functools.partial(
        _extend_kernel,
        cache_shape=k_cache.shape,
        group=group,
        block_m=plan.block_m,
        block_n=plan.block_n,
        splits=plan.num_splits,
        scale_log2=float(sm_scale) * LOG2E,
        softcap=None if logit_softcap is None else float(logit_softcap),
        tree=tree,
        sinks=sinks is not None,
        write_final=write_final,
    )
    # Sequences with no new tokens run no program: their KV does not set the split length.
    q_lens = query_start[1:] - query_start[:-1]
    capacity = page_tables.shape[1] * k_cache.shape[2]
    kv_lens = jnp.where(q_lens > 0, jnp.minimum(seq_lens.astype(jnp.int32), capacity), 0)
    window = window_scalar(window)
    # A window bounds what one query reads, and a block's rows add at most max_q_len.
    split_kv = jnp.minimum(kv_lens, window + max_q_len)
    block_seq, block_index = query_block_table(q_lens, plan.block_m // group, plan.num_items)
    inputs = [
        jnp.stack([jnp.reshape(layer, ()).astype(jnp.int32), window]),
        runtime_split_len(split_kv, plan.num_splits, plan.block_n, plan.min_split_len),
        block_seq,
        block_index,
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        query_start.astype(jnp.int32),
        q,
        cache_rows(k_cache),
        cache_rows(v_cache),
    ]
    if tree:
        inputs.append(mask.astype(jnp.int8))
        inputs.append(tree_depth(mask))
    if sinks is not None:
        inputs.append(sinks.astype(jnp.float32))
    if write_final:
        # Rows no program owns (padding past query_start[B]) must read as zeros.
        inputs.append(jnp.zeros(q.shape, q.dtype))
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
        aliases = {len(inputs) - 1: 0}
    else:
        partial = (plan.num_splits, num_rows, num_q_heads)
        out_shape = [
            jax.ShapeDtypeStruct((*partial, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
        ]
        aliases = {}
    outs = pl.pallas_call(
        kernel,
        grid=(plan.num_items, plan.num_splits, num_kv_heads),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=resolve_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=plan.num_warps, num_stages=plan.num_stages),
        name=f"paged_extend_s{k_cache.shape[2]}_g{group}_m{plan.block_m}_n{plan.block_n}{'_tree' if tree else ''}",
    )(*inputs)
    if write_final:
        return outs[0]
    acc, m, l = outs
    out = merge_splits(acc, m, l, axis=0)
    real = jnp.arange(num_rows) < query_start[batch]
    # Padding rows were never written: select, not multiply (they may hold NaN).
    return jnp.where(real[:, None, None], out, 0.0).astype(q.dtype)

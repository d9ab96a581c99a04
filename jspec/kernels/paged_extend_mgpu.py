"""Paged attention for a ragged batch of new tokens (prefill chunks, tree verification), Pallas
over Mosaic GPU (Hopper).

The same contract as paged_extend.paged_extend (same arguments, same outputs; causal, or a tree
mask: the prefix fully visible, new token i seeing new token k iff mask[b, i, k]; sliding
windows, soft-caps and sinks included) for 16-bit and FP8 KV pools, pages of 8 or more tokens
and trees of at most MAX_TREE_TOKENS tokens. Anything else raises MosaicUnsupported, naming the
feature; mosaic_extend_unsupported() asks first.

Grid (query block, context split, kv head), one warpgroup per program, over the batch's query
blocks themselves (paged_tiles.query_block_table: each sequence's blocks, highest first, since
under a causal mask they read the most KV), so a few prompts among many one-token rows gather,
launch and write back the blocks that exist, not batch x the longest query's. A query block is GROUP_ROWS rows, the M
side of both wgmmas: tokens_per_block consecutive new tokens of one sequence times the GQA group
sharing the kv head (token-major), then padding rows; a query shorter than a block (a tree of 8
at group 4) moves only the rows that may hold a token (block_rows). The blocks are gathered from
the ragged q once per call in jnp, with two per-row facts the masks need: the last KV position
the row sees causally (the prefix's last, under a tree; -1 for a padding row), and under a tree
the row's mask as bits (a word per 32 new tokens). The kernel writes blocks, which jnp gathers
back into the ragged [T, Hq, D] layout (and merges first, over several context splits): a TMA
box cannot stop at a sequence's last token, and rows past it belong to the next sequence.

Per program, the KV tiles below every row's causal reach (the prefix, under a tree) run
unmasked; the rest, up to the block's last token, are masked. Under a sliding window each row
also carries its window's first position (a tree node's position is the prefix plus its depth):
the splits start on the tile holding the block's lowest one, and the tiles below the highest one
are masked too. Sinks enter as each row's initial state in the first split, as in the decode
kernel. KV moves by TMA as in the decode
kernel (mgpu_tiles.issue_kv_tile), num_stages tiles in flight, one pipeline across both loops.
The interpreter shapes the tile step as it does the decode kernel's (paged_decode_mgpu).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.kernels.mgpu_tiles import (
    GROUP_ROWS,
    MASK_WORD_BITS,
    SMEM_BYTES,
    MosaicUnsupported,
    attend_kv_tile,
    check_block_n,
    initial_rows,
    interpret_params,
    issue_kv_tile,
    mask_word_bits,
    paged_unsupported,
    rows_after_sinks,
    seen_or_in_words,
    split_sink_rows,
    swizzled,
    tile_smem_bytes,
    upcast_kv_tiles,
    upcast_tiles_smem,
    wgmma_dtype,
)
from jspec.kernels.paged_tiles import (
    LOG2E,
    choose_splits,
    merge_splits,
    min_split_len,
    query_block_count,
    query_block_table,
    runtime_split_len,
    tree_depth,
    window_scalar,
)

GRID_AXES = ("item", "split", "kv_head")
# A tree's mask rows travel as 32-bit words; each masked tile tests every word, so trees stay small.
MAX_TREE_TOKENS = 256


def mosaic_extend_unsupported(
    cache_shape,
    cache_dtype,
    num_q_heads,
    *,
    max_q_len=None,
    tree=False,
    num_warps=None,
) -> str | None:
    """The first feature of this call that the Mosaic extend kernel lacks, or None if it can run
    it. max_q_len: the bound on new tokens per sequence (a tree mask's side)."""
    feature = paged_unsupported(cache_shape, cache_dtype, num_q_heads, num_warps=4 if num_warps is None else num_warps)
    if feature is None and tree and max_q_len is not None and max_q_len > MAX_TREE_TOKENS:
        return f"a tree mask over {max_q_len} tokens (at most {MAX_TREE_TOKENS})"
    return feature


class MosaicExtendPlan(NamedTuple):
    """Static launch settings, resolved from shapes and the tuning arguments."""

    tokens_per_block: int  # new tokens of one sequence in a query block (times the group: its rows)
    block_rows: int  # rows of a block that may hold a token (a multiple of 8): gathered and written back
    num_q_blocks: int  # query blocks of the longest query
    num_items: int  # query blocks the grid holds: enough for any ragged batch of these shapes
    block_n: int  # KV tokens per tile
    rows_per_copy: int  # tokens per TMA copy: a page, or a tile of a longer page
    num_splits: int
    min_split_len: int  # floor of the runtime KV tokens per split, a multiple of block_n
    num_stages: int  # KV tiles in shared memory at once
    mask_words: int  # 32-bit words of a tree mask row (0: causal)
    scale_log2: float


def mosaic_extend_plan(
    batch,
    num_q_heads,
    cache_shape,
    max_pages,
    max_q_len,
    num_rows=None,
    *,
    sm_scale,
    tree=False,
    block_n=None,
    num_splits=None,
    min_split_tokens=256,
    num_stages=2,
    cache_dtype=jnp.bfloat16,
) -> MosaicExtendPlan:
    _, _, page_size, num_kv_heads, head_dim = cache_shape
    group = num_q_heads // num_kv_heads
    block_n = block_n or 64
    check_block_n(block_n)
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    words = -(-max_q_len // MASK_WORD_BITS) if tree else 0
    smem = tile_smem_bytes(head_dim, block_n, num_stages, cache_dtype) + 4 * GROUP_ROWS * (1 + words)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"block_n {block_n} x num_stages {num_stages} at head_dim {head_dim} needs {smem} bytes of shared memory"
        )
    tokens_per_block = GROUP_ROWS // group
    num_q_blocks = -(-max_q_len // tokens_per_block)
    # Short queries (tree verify) fill part of a block: the rest is neither gathered nor written.
    block_rows = min(GROUP_ROWS, -(-min(tokens_per_block, max_q_len) * group // 8) * 8)
    num_items = query_block_count(batch, num_q_blocks, tokens_per_block, num_rows)
    splits, _ = choose_splits(max_pages * page_size, num_items * num_kv_heads, block_n, min_split_tokens, num_splits)
    return MosaicExtendPlan(
        tokens_per_block,
        block_rows,
        num_q_blocks,
        num_items,
        block_n,
        min(page_size, block_n),
        splits,
        min_split_len(block_n, min_split_tokens, num_splits),
        num_stages,
        words,
        float(sm_scale) * LOG2E,
    )


def _attend_block(
    scalars_ref,
    seq_lens_ref,
    page_tables_ref,
    query_start_ref,
    q_ref,
    row_limit_ref,
    mask_bits_ref,
    window_refs,
    sinks_ref,
    k_ref,
    v_ref,
    q_smem,
    k_smem,
    v_smem,
    p_smem,
    row_limit_smem,
    mask_bits_smem,
    row_lo_smem,
    sink_smem,
    q_barrier,
    k_barriers,
    v_barriers,
    *upcast,
    plan,
    cache_shape,
    seq,
    item,
    block,
    split,
    first,
    q_len,
    softcap,
):
    """This program's query block over its split of the context: its online-softmax state (m, l, acc).
    item indexes the per-row facts (one set per query block of the batch), block the q block (one
    per kv head too). upcast: over an FP8 pool, the 16-bit K and V tiles each byte tile is
    written to before its wgmmas (empty otherwise)."""
    kv_head = lax.axis_index("kv_head")
    _, num_pages, page_size, _, head_dim = cache_shape
    block_n, stages, tree = plan.block_n, plan.num_stages, plan.mask_words > 0
    layer, split_len = scalars_ref[0], scalars_ref[1]
    kv_len = jnp.minimum(seq_lens_ref[seq], page_tables_ref.shape[1] * page_size)
    prefix = kv_len - q_len  # KV entries before the new tokens
    last = jnp.minimum(first + plan.tokens_per_block, q_len) - 1
    # Causal: nothing past the block's last token; tree: any new token may be visible.
    reach = kv_len if tree else prefix + last + 1
    base, seen_by_all_from = 0, 0
    if window_refs is not None:
        # The block's rows' window starts, lowest and highest: the splits start on the tile of
        # the lowest; below the highest, some row is out of its window.
        row_lo_ref, bounds_ref = window_refs
        base = lax.div(bounds_ref[item, 0], block_n) * block_n
        seen_by_all_from = bounds_ref[item, 1]
    lo = base + split * split_len
    hi = jnp.minimum(lo + split_len, reach)
    # Positions every row sees: the prefix (tree), up to the block's first token (causal).
    unmasked_end = prefix if tree else prefix + first + 1
    num_tiles = lax.div(jnp.maximum(hi - lo, 0) + block_n - 1, block_n)
    num_head = 0
    if window_refs is not None:
        num_head = jnp.clip(lax.div(seen_by_all_from - lo + block_n - 1, block_n), 0, num_tiles)
    num_full = jnp.maximum(num_head, lax.div(jnp.maximum(jnp.minimum(unmasked_end, hi) - lo, 0), block_n))

    def issue_tile(t):
        issue_kv_tile(
            k_ref,
            v_ref,
            page_tables_ref,
            k_smem,
            v_smem,
            k_barriers,
            v_barriers,
            seq=seq,
            kv_head=kv_head,
            layer=layer,
            start=lo + t * block_n,
            hi=hi,
            slot=lax.rem(t, stages),
            page_size=page_size,
            num_pages=num_pages,
            block_n=block_n,
            rows_per_copy=plan.rows_per_copy,
        )

    # Rows past block_rows stay as they are: no token is there, and rows do not mix in either
    # wgmma, so whatever they hold stays in rows that are never written back.
    plgpu.copy_gmem_to_smem(q_ref.at[block], q_smem.at[pl.ds(0, plan.block_rows)], q_barrier)
    plgpu.copy_gmem_to_smem(row_limit_ref.at[item], row_limit_smem, q_barrier)
    if tree:
        plgpu.copy_gmem_to_smem(mask_bits_ref.at[item], mask_bits_smem, q_barrier)
    if window_refs is not None:
        plgpu.copy_gmem_to_smem(row_lo_ref.at[item], row_lo_smem, q_barrier)
    if sinks_ref is not None:
        plgpu.copy_gmem_to_smem(sinks_ref.at[split, lax.axis_index("kv_head")], sink_smem, q_barrier)
    for t in range(stages - 1):
        pl.when(t < num_tiles)(functools.partial(issue_tile, t))
    plgpu.barrier_wait(q_barrier)
    row_facts = plgpu.Layout.WGMMA.reduce(1)
    row_limit = plgpu.load(row_limit_smem, layout=row_facts)
    row_lo = plgpu.load(row_lo_smem, layout=row_facts) if window_refs is not None else None

    def visible(positions):
        seen = positions <= lax.broadcast_in_dim(row_limit, positions.shape, [0])
        if row_lo is not None:
            seen &= positions >= lax.broadcast_in_dim(row_lo, positions.shape, [0])
        if tree:
            rows_words = (plgpu.load(mask_bits_smem.at[word], layout=row_facts) for word in range(plan.mask_words))
            words = [lax.broadcast_in_dim(bits, positions.shape, [0]) for bits in rows_words]
            seen = seen_or_in_words(seen, positions - prefix, words)
        return seen

    def attend_tile(t, carry, *, masked):
        slot = lax.rem(t, stages)
        pl.when(t + stages - 1 < num_tiles)(lambda: issue_tile(t + stages - 1))
        plgpu.barrier_wait(k_barriers.at[slot])
        k_tile, v_tile, v_barrier = k_smem.at[slot], v_smem.at[slot], v_barriers.at[slot]
        if upcast:
            k_tile, v_tile, v_barrier = (*upcast_kv_tiles(k_tile, v_tile, v_barrier, *upcast), None)
        return attend_kv_tile(
            q_smem,
            k_tile,
            v_tile,
            v_barrier,
            p_smem,
            carry,
            start=lo + t * block_n,
            hi=hi,
            scale_log2=plan.scale_log2,
            visible=visible if masked else None,
            check_hi=masked,
            softcap=softcap,
        )

    carry = initial_rows(head_dim) if sinks_ref is None else rows_after_sinks(sink_smem, head_dim)
    if window_refs is not None:
        carry = lax.fori_loop(0, num_head, functools.partial(attend_tile, masked=True), carry)
    carry = lax.fori_loop(num_head, num_full, functools.partial(attend_tile, masked=False), carry)
    return lax.fori_loop(num_full, num_tiles, functools.partial(attend_tile, masked=True), carry)


def _write_out(out_ref, out_smem, m, l, acc, *, block):
    out_smem[...] = (acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])).astype(out_smem.dtype)
    plgpu.commit_smem()
    rows = pl.ds(0, out_ref.shape[1])
    plgpu.copy_smem_to_gmem(out_smem.at[rows], out_ref.at[block])
    plgpu.wait_smem_to_gmem(0)


def _write_partials(acc_ref, m_ref, l_ref, acc_smem, m_smem, l_smem, m, l, acc, *, block, split):
    acc_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    rows = pl.ds(0, acc_ref.shape[2])
    plgpu.copy_smem_to_gmem(acc_smem.at[rows], acc_ref.at[block, split])
    plgpu.copy_smem_to_gmem(m_smem.at[rows], m_ref.at[block, split])
    plgpu.copy_smem_to_gmem(l_smem.at[rows], l_ref.at[block, split])
    plgpu.wait_smem_to_gmem(0)


def _extend_kernel(
    scalars_ref,
    item_seq_ref,
    item_block_ref,
    seq_lens_ref,
    page_tables_ref,
    query_start_ref,
    q_ref,
    row_limit_ref,
    *refs,
    plan,
    cache_shape,
    windowed,
    sinks,
    softcap,
):
    tree = plan.mask_words > 0
    refs = list(refs)
    mask_bits_ref = refs.pop(0) if tree else None
    window_refs = (refs.pop(0), refs.pop(0)) if windowed else None
    sinks_ref = refs.pop(0) if sinks else None
    k_ref, v_ref, *out_refs = refs
    _, _, _, num_kv_heads, head_dim = cache_shape
    kv, stages, block_n = k_ref.dtype, plan.num_stages, plan.block_n
    dtype = wgmma_dtype(kv)
    item, split, kv_head = (lax.axis_index(axis) for axis in GRID_AXES)
    # The item's sequence (-1 past the batch's blocks: the program does nothing) and block.
    real_seq, q_block = item_seq_ref[item], item_block_ref[item]
    seq = jnp.maximum(real_seq, 0)
    q_len = jnp.where(real_seq >= 0, query_start_ref[seq + 1] - query_start_ref[seq], 0)
    first = q_block * plan.tokens_per_block  # first new token of this block, within its sequence
    block = item * num_kv_heads + kv_head
    copies = block_n // plan.rows_per_copy
    scratch = [
        plgpu.SMEM((GROUP_ROWS, head_dim), dtype, transforms=swizzled(head_dim, dtype)),
        plgpu.SMEM((stages, block_n, head_dim), kv, transforms=swizzled(head_dim, kv)),
        plgpu.SMEM((stages, block_n, head_dim), kv, transforms=swizzled(head_dim, kv)),
        plgpu.SMEM((GROUP_ROWS, block_n), dtype, transforms=swizzled(block_n, dtype)),
        plgpu.SMEM((GROUP_ROWS,), jnp.int32),
        plgpu.SMEM((max(plan.mask_words, 1), GROUP_ROWS), jnp.int32),
        plgpu.SMEM((GROUP_ROWS,), jnp.int32),  # the rows' window starts (unused without)
        plgpu.SMEM((GROUP_ROWS,), jnp.float32),  # the rows' initial running max with sinks (unused without)
        # q, the rows' limits, and each of the mask bits, window starts and sinks a call has.
        plgpu.Barrier(num_arrivals=2 + tree + windowed + sinks),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
        plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
    ]
    scratch += upcast_tiles_smem(block_n, head_dim, kv)
    attend = functools.partial(
        _attend_block,
        scalars_ref,
        seq_lens_ref,
        page_tables_ref,
        query_start_ref,
        q_ref,
        row_limit_ref,
        mask_bits_ref,
        window_refs,
        sinks_ref,
        k_ref,
        v_ref,
        plan=plan,
        cache_shape=cache_shape,
        seq=seq,
        item=item,
        block=block,
        split=split,
        first=first,
        q_len=q_len,
        softcap=softcap,
    )

    # A block past its sequence's new tokens does nothing: no row of it is ever read back.
    @pl.when(first < q_len)
    def _():
        # Two scopes, one after the other: the epilogue's buffers reuse the tiles' shared memory.
        m, l, acc = pl.run_scoped(attend, *scratch)
        if len(out_refs) == 1:
            (out_ref,) = out_refs
            write = functools.partial(_write_out, out_ref, block=block)
            pl.run_scoped(lambda smem: write(smem, m, l, acc), plgpu.SMEM((GROUP_ROWS, head_dim), out_ref.dtype))
        else:
            write = functools.partial(_write_partials, *out_refs, block=block, split=split)
            pl.run_scoped(
                lambda *smem: write(*smem, m, l, acc),
                plgpu.SMEM((GROUP_ROWS, head_dim), jnp.float32),
                plgpu.SMEM((GROUP_ROWS,), jnp.float32),
                plgpu.SMEM((GROUP_ROWS,), jnp.float32),
            )


def _row_layout(group: int, tokens_per_block: int):
    """Static (token within the block, head within the group, real row) of each of GROUP_ROWS rows."""
    rows = np.arange(GROUP_ROWS)
    return rows // group, rows % group, rows < tokens_per_block * group


def window_starts(row_pos, valid, window):
    """Each row's first position in its window [NI, GROUP_ROWS] (row_pos - window + 1; padding
    rows anything), and per block the lowest and highest of its real rows', clamped at 0 [NI, 2]."""
    row_lo = (row_pos - (window - 1)).reshape(-1, GROUP_ROWS).astype(jnp.int32)
    valid = valid.reshape(-1, GROUP_ROWS)
    big = jnp.iinfo(jnp.int32).max
    lowest = jnp.min(jnp.where(valid, row_lo, big), axis=1)
    highest = jnp.max(jnp.where(valid, row_lo, 0), axis=1)
    bounds = jnp.stack([jnp.where(lowest == big, 0, jnp.maximum(lowest, 0)), jnp.maximum(highest, 0)], axis=1)
    return row_lo, bounds.astype(jnp.int32)


def query_blocks(q, query_start, kv_lens, mask, plan, *, num_kv_heads, dtype):
    """The per-call gathers, one per grid item (paged_tiles.query_block_table's order, NI =
    plan.num_items): q blocks [NI * Hkv, block_rows, D] in dtype (the wgmmas'), each row's causal
    limit [NI, GROUP_ROWS], under a tree its mask bits [NI, words, GROUP_ROWS] (else None), and
    (position, real row) [NI, GROUP_ROWS] per row, for window_starts: the prefix plus the row's
    token, or under a tree its depth; and the items' (sequence, block) [NI] each, the kernel's
    table. An item past the batch's blocks has sequence -1 and no real row."""
    num_rows, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    token_in_block, head_in_group, real_row = _row_layout(group, plan.tokens_per_block)
    q_lens = query_start[1:] - query_start[:-1]
    item_seq, item_block = query_block_table(q_lens, plan.tokens_per_block, plan.num_items)
    seq = jnp.maximum(item_seq, 0)[:, None]  # [NI, 1]
    token = item_block[:, None] * plan.tokens_per_block + token_in_block[None, :]  # [NI, R]
    valid = real_row & (item_seq >= 0)[:, None] & (token < q_lens[seq])  # [NI, R]
    gathered = slice(0, plan.block_rows)
    flat_row = jnp.clip(query_start[seq] + token[:, gathered], 0, num_rows - 1)
    heads = np.arange(num_kv_heads)[:, None] * group + head_in_group[None, gathered]  # [Hkv, block_rows]
    blocks = q[flat_row[:, None, :], heads[None]]  # [NI, Hkv, block_rows, D]
    # Select, not multiply: padding rows of q may hold anything, NaN included.
    blocks = jnp.where(valid[:, None, gathered, None], blocks, 0).astype(dtype)
    blocks = blocks.reshape(-1, plan.block_rows, head_dim)
    prefix = (kv_lens - q_lens)[seq]
    limit = prefix - 1 if mask is not None else prefix + token
    row_limit = jnp.where(valid, limit, -1).astype(jnp.int32)
    table = (item_seq, item_block)
    if mask is None:
        return blocks, row_limit, None, (prefix + token, valid), table
    max_q_len = mask.shape[-1]
    within = jnp.minimum(token, max_q_len - 1)
    row_pos = prefix + tree_depth(mask)[seq, within]
    rows_mask = mask.astype(bool)[seq, within] & valid[..., None]  # [NI, R, Q]
    bits = mask_word_bits(rows_mask, plan.mask_words).transpose(0, 2, 1)  # [NI, W, R]
    return blocks, row_limit, bits, (row_pos, valid), table


def initial_sink_rows(sinks, plan, *, num_kv_heads, group):
    """Each split's initial running max of a block's rows per kv head [NS, Hkv, GROUP_ROWS]
    (mgpu_tiles.split_sink_rows), each row taking its head's sink."""
    _, head_in_group, _ = _row_layout(group, plan.tokens_per_block)
    heads = np.arange(num_kv_heads)[:, None] * group + head_in_group[None, :]
    return split_sink_rows(sinks[heads], plan.num_splits)


def ragged_rows(blocks, query_start, plan, *, num_rows, num_q_heads, num_kv_heads):
    """Blocks [NI * Hkv, block_rows, D] in query_blocks' layout back to q's ragged
    [num_rows, Hq, D]; rows from query_start[B] on are zeros."""
    batch = query_start.shape[0] - 1
    group = num_q_heads // num_kv_heads
    # Row t is token t - query_start[b] of the sequence b holding it.
    t = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, batch - 1)
    token = t - query_start[seq]
    q_block = lax.div(token, plan.tokens_per_block)
    # Its item: sequence b's blocks end at the running count of blocks, highest first.
    ends = jnp.cumsum(-(-(query_start[1:] - query_start[:-1]) // plan.tokens_per_block))
    item = jnp.clip(ends[seq] - 1 - q_block, 0, plan.num_items - 1)
    heads = jnp.arange(num_q_heads, dtype=jnp.int32)
    block = item[:, None] * num_kv_heads + (heads // group)[None, :]
    row = lax.rem(token, plan.tokens_per_block)[:, None] * group + (heads % group)[None, :]
    out = blocks[block, row]  # [T, Hq, D]
    # Rows no program owns were never written: select, not multiply (they may hold NaN).
    return jnp.where((t < query_start[batch])[:, None, None], out, 0)


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
def paged_extend_mgpu(
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
    min_split_tokens=256,
    num_warps=None,
    num_stages=2,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """paged_extend.paged_extend on Mosaic GPU: the same arguments and results (see there).

    Raises MosaicUnsupported for what mosaic_extend_unsupported() names. Tuning: block_m must be
    None or GROUP_ROWS (a query block is one wgmma's rows); block_n KV tokens per tile (64, 128 or
    256); num_splits and min_split_tokens as the Triton kernel's; num_stages KV tiles in flight;
    num_warps None or 4 (one warpgroup). interpret as paged_decode_mgpu's.
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[3]
    batch = seq_lens.shape[0]
    if k_cache.shape[4] != head_dim or num_q_heads % num_kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {q.shape} does not fit the caches {k_cache.shape}, {v_cache.shape}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the caches differ in dtype: {k_cache.dtype}, {v_cache.dtype}")
    if query_start.shape != (batch + 1,):
        raise ValueError(f"query_start must be [B+1] = [{batch + 1}], got {query_start.shape}")
    if mask is not None and mask.shape != (batch, max_q_len, max_q_len):
        raise ValueError(f"mask must be [B, max_q_len, max_q_len], got {mask.shape}")
    feature = mosaic_extend_unsupported(
        k_cache.shape,
        k_cache.dtype,
        num_q_heads,
        max_q_len=max_q_len,
        tree=mask is not None,
        num_warps=num_warps,
    )
    if feature is not None:
        raise MosaicUnsupported(feature, kernel="extend")
    if block_m not in (None, GROUP_ROWS):
        raise ValueError(f"block_m must be None or {GROUP_ROWS} (one wgmma's rows), got {block_m}")
    num_layers, num_pages, page_size, _, _ = k_cache.shape
    plan = mosaic_extend_plan(
        batch,
        num_q_heads,
        k_cache.shape,
        page_tables.shape[1],
        max_q_len,
        num_rows,
        sm_scale=sm_scale,
        tree=mask is not None,
        block_n=block_n,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
        num_stages=num_stages,
        cache_dtype=k_cache.dtype,
    )
    group = num_q_heads // num_kv_heads
    write_final = plan.num_splits == 1
    query_start = query_start.astype(jnp.int32)
    q_lens = query_start[1:] - query_start[:-1]
    kv_lens = jnp.minimum(seq_lens.astype(jnp.int32), page_tables.shape[1] * page_size)
    span = kv_lens
    if window is not None:
        # A block's splits cover its rows' windows from the tile of the lowest start.
        window = window_scalar(window)
        span = jnp.minimum(kv_lens, window + (max_q_len + plan.block_n - 1))
    # Sequences with no new tokens run no program: their KV does not set the split length.
    split_len = runtime_split_len(jnp.where(q_lens > 0, span, 0), plan.num_splits, plan.block_n, plan.min_split_len)
    blocks, row_limit, mask_bits, (row_pos, valid), (item_seq, item_block) = query_blocks(
        q,
        query_start,
        kv_lens,
        mask,
        plan,
        num_kv_heads=num_kv_heads,
        dtype=wgmma_dtype(k_cache.dtype),
    )
    num_blocks = blocks.shape[0]
    if write_final:
        out_type = jax.ShapeDtypeStruct(blocks.shape, q.dtype)
    else:
        partial = (num_blocks, plan.num_splits, plan.block_rows)
        out_type = (
            jax.ShapeDtypeStruct((*partial, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
            jax.ShapeDtypeStruct(partial, jnp.float32),
        )
    tree = "_tree" if mask is not None else ""
    kernel = plgpu.kernel(
        functools.partial(
            _extend_kernel,
            plan=plan,
            cache_shape=k_cache.shape,
            windowed=window is not None,
            sinks=sinks is not None,
            softcap=None if logit_softcap is None else float(logit_softcap),
        ),
        out_type=out_type,
        grid=(plan.num_items, plan.num_splits, num_kv_heads),
        grid_names=GRID_AXES,
        interpret=interpret_params(interpret),
        kernel_name=f"paged_extend_mgpu_s{page_size}_g{group}_n{plan.block_n}{tree}",
    )
    pages = (num_layers * num_pages, page_size, num_kv_heads, head_dim)  # a free reshape: layer and page in one index
    inputs = [
        jnp.stack([jnp.reshape(layer, ()).astype(jnp.int32), split_len[0]]),
        item_seq,
        item_block,
        seq_lens.astype(jnp.int32),
        page_tables.astype(jnp.int32),
        query_start,
        blocks,
        row_limit,
    ]
    if mask_bits is not None:
        inputs.append(mask_bits)
    if window is not None:
        inputs.extend(window_starts(row_pos, valid, window))
    if sinks is not None:
        inputs.append(initial_sink_rows(sinks, plan, num_kv_heads=num_kv_heads, group=group))
    outs = kernel(*inputs, k_cache.reshape(pages), v_cache.reshape(pages))
    out_blocks = outs if write_final else merge_splits(*outs, axis=1)
    out = ragged_rows(
        out_blocks, query_start, plan, num_rows=num_rows, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads
    )
    return out.astype(q.dtype)

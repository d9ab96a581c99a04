"""Builds the padded numpy arrays of a ForwardBatch from per-sequence chunks.

Shapes are rounded up to buckets (powers of two) so the number of compiled
programs stays small: tokens T, sequences B and pages-per-sequence M.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.layers.batch import AttentionMode, ForwardBatch, bucket


@dataclasses.dataclass
class SeqChunk:
    """New tokens of one sequence for one forward: they occupy KV positions start..start+len-1."""

    tokens: list[int]
    start: int  # KV length before this chunk
    page_table: list[int]  # pages covering at least start + len(tokens) positions


def build_forward_batch(
    chunks: list[SeqChunk],
    *,
    page_size: int,
    num_pages: int,
    min_tokens: int = 8,
    min_seqs: int = 1,
    min_pages: int = 1,
    allow_decode_only: bool = True,
    num_tokens: int | None = None,
) -> tuple[ForwardBatch, AttentionMode]:
    """Pads the chunks into one ForwardBatch (numpy arrays) and its static AttentionMode.

    logits_indices has one row per sequence slot: the last new token of each
    chunk (padding slots point at row 0 and are ignored by the caller). num_tokens: the
    padded token count T (the caller's bucket), else the power of two at or above the total.
    """
    if not chunks:
        raise ValueError("cannot build a batch with no sequences")
    qlens = [len(c.tokens) for c in chunks]
    total = sum(qlens)
    B = bucket(len(chunks), min_seqs)
    decode_only = allow_decode_only and all(q == 1 for q in qlens)
    # A decode-only batch has exactly one row per sequence slot (T == B).
    T = B if decode_only else (num_tokens or bucket(total, min_tokens))
    if total > T:
        raise ValueError(f"{total} tokens do not fit a batch of {T}")
    M = bucket(max(-(-(c.start + len(c.tokens)) // page_size) for c in chunks), min_pages)
    drop_slot = num_pages * page_size

    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.full(T, drop_slot, np.int32)
    seq_lens = np.zeros(B, np.int32)
    page_tables = np.zeros((B, M), np.int32)  # page 0 is scratch: padding reads it harmlessly
    query_start = np.zeros(B + 1, np.int32)
    logits_indices = np.zeros(B, np.int32)

    row = 0
    for b, c in enumerate(chunks):
        n = len(c.tokens)
        end = c.start + n
        needed = -(-end // page_size)
        if len(c.page_table) < needed:
            raise ValueError(
                f"sequence {b} needs {needed} pages for {end} tokens, its page table has {len(c.page_table)}"
            )
        pos = np.arange(c.start, end)
        pt = np.asarray(c.page_table[:needed], np.int32)
        tokens[row : row + n] = c.tokens
        positions[row : row + n] = pos
        slots[row : row + n] = pt[pos // page_size] * page_size + pos % page_size
        seq_lens[b] = end
        page_tables[b, :needed] = pt
        logits_indices[b] = row + n - 1
        row += n
        query_start[b + 1] = row
    query_start[len(chunks) + 1 :] = row

    batch = ForwardBatch(tokens, positions, slots, seq_lens, page_tables, query_start, logits_indices)
    # max_q_len is static: one bucket per token bucket T keeps the program count at one per T.
    mode = AttentionMode(decode_only=decode_only, max_q_len=1 if decode_only else T)
    return batch, mode

"""A step's input arrays, built on the host from what the scheduler asks for.

`build_forward_batch` pads per-sequence chunks into a ForwardBatch; `prefill_inputs` and
`decode_inputs` add what a prefill and a decode step take besides (sampling rows, slots,
penalty counts, adapter slots). Shapes are rounded up to buckets (worker/programs.py: Buckets)
so the number of compiled programs stays small: tokens T, sequences B and pages-per-sequence M.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.config.sampling import SamplingParams
from jspec.constrained.grammar import allow_all
from jspec.layers.batch import AttentionMode, ForwardBatch, bucket
from jspec.layers.lora import LoraBatch
from jspec.layers.penalties import PrefillCounts, logit_bias_rows
from jspec.layers.sampling import SamplingRows, sampling_rows


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


def prefill_rows(worker, T: int) -> int:
    """Sequences a prefill of T tokens pads to: every chunk holds a token, so there are at most
    T of them (and at most the worker's slots); fewer rows, fewer logits and samples."""
    return bucket(min(worker.max_slots, T))


def prefill_inputs(
    worker,
    chunks: list[SeqChunk],
    following: list[int | None],
    slots: list[int | None],
    output_starts: list[int] | None,
    first_chunks: list[bool] | None,
    min_tokens: int = 8,
    decode_rows: list[bool] | None = None,
    logit_biases: list[dict[int, float] | None] | None = None,
):
    """A prefill's arrays on worker's geometry (its buckets, pages, slots and attention backend):
    (batch, mode, the token after each row, finish rows, slot ids, penalty counts).

    output_starts: per chunk, the position where its request's generated tokens begin
    (the prompt length; a re-prefill after retraction runs over both); first_chunks: the
    chunk is its request's first (its penalty counts start afresh). None: prompts only, all first.
    decode_rows: the chunk is a running request's decode row, whose token its penalty counts
    already hold (counted when it was sampled).
    min_tokens: the smallest token bucket (DP attention gives every rank the largest rank's).
    logit_biases: per chunk, its request's logit_bias (None: none), written where it starts."""
    T = worker.buckets.prefill_tokens(max(sum(len(c.tokens) for c in chunks), min_tokens))
    batch, mode = build_forward_batch(
        chunks,
        page_size=worker.page_size,
        num_pages=worker.num_pages,
        min_seqs=prefill_rows(worker, T),
        min_pages=worker.table_width,
        allow_decode_only=False,
        num_tokens=T,
    )
    mode = mode._replace(backend=worker.backend)
    T, B = batch.tokens.shape[0], batch.seq_lens.shape[0]
    scratch = worker.scratch_slot
    draft_tokens = np.zeros(T, np.int32)  # the token after each row (draft inputs, prompt logprobs)
    finish_rows = np.full(B, T, np.int32)
    slot_ids = np.full(B, scratch, np.int32)
    reset_slots = np.full(B, scratch, np.int32)
    token_slots = np.full(T, scratch, np.int32)
    is_output = np.zeros(T, bool)
    for i, c in enumerate(chunks):
        start, n = batch.query_start[i], len(c.tokens)
        slot = scratch if slots[i] is None else slots[i]
        if not (decode_rows and decode_rows[i]):
            token_slots[start : start + n] = slot
        if output_starts is not None:
            is_output[start : start + n] = np.arange(c.start, c.start + n) >= output_starts[i]
        if first_chunks is None or first_chunks[i]:
            reset_slots[i] = slot
        draft_tokens[start : start + n - 1] = c.tokens[1:]
        if following[i] is None:
            finish_rows[i] = start + n - 1
            slot_ids[i] = slots[i]
        else:
            draft_tokens[start + n - 1] = following[i]
    starting = [b if reset_slots[i] != scratch else None for i, b in enumerate(logit_biases or [])]
    bias = logit_bias_rows(starting, B, worker.vocab_size)
    return batch, mode, draft_tokens, finish_rows, slot_ids, PrefillCounts(reset_slots, token_slots, is_output, *bias)


def decode_inputs(worker, slots: list[int], page_tables: list[list[int]], sampling):
    """A decode's arrays, padded to its row bucket with scratch rows: (slot ids [B], page tables
    [B, table width], SamplingRows)."""
    B, M = worker.buckets.decode_bucket(len(slots)), worker.table_width
    slot_ids = np.full(B, worker.scratch_slot, np.int32)
    slot_ids[: len(slots)] = slots
    pt = np.zeros((B, M), np.int32)
    for i, p in enumerate(page_tables):
        pt[i, : len(p)] = p
    return slot_ids, pt, rows_of(sampling, B)


def rows_of(sampling: list[tuple[SamplingParams, int]], n: int) -> SamplingRows:
    """The SamplingRows of (params, seed) pairs, padded to n rows."""
    return sampling_rows([p for p, _ in sampling], [s for _, s in sampling], n)


def carry_slots(query_start, chunks, slots, decode_rows, T: int) -> np.ndarray:
    """Each prefill token's source [T]: the slot whose carried next token it is (a decode row's
    one token), else -1 (the token the host gave)."""
    out = np.full(T, -1, np.int32)
    for i, row in enumerate(decode_rows or ()):
        if row:
            out[query_start[i]] = slots[i]
    return out


def prefill_lora_slots(batch, chunks, loras) -> np.ndarray:
    """Each prefill token's adapter slot [T] (padding rows, or no loras: 0)."""
    ids = np.zeros(batch.tokens.shape[0], np.int32)
    for i, c in enumerate(chunks if loras is not None else ()):
        start = batch.query_start[i]
        ids[start : start + len(c.tokens)] = loras[i]
    return ids


def decode_lora_slots(B: int, loras) -> np.ndarray:
    """Each decode row's adapter slot [B] (padding rows, or no loras: 0)."""
    ids = np.zeros(B, np.int32)
    if loras is not None:
        ids[: len(loras)] = loras
    return ids


def lora_batch(pool, per_token: np.ndarray) -> LoraBatch | None:
    """A step's LoRA argument: None without a pool (jspec.lora.pool.LoraPool), so those programs
    stay as they were."""
    return None if pool is None else LoraBatch(pool.weights, per_token)


def padded_vocab_masks(masks: np.ndarray, rows: int, vocab_size: int) -> np.ndarray:
    """Token bitmasks [n, words] padded with allow-all rows to `rows`."""
    full = allow_all(rows, vocab_size)
    full[: len(masks)] = masks
    return full


@dataclasses.dataclass
class DecodeInputs:
    """The last decode batch: what the scheduler asked for, and the arrays built for it."""

    slots: list[int]
    page_tables: list[list[int]]
    sampling: list[tuple[SamplingParams, int]]
    loras: list[int] | None
    arrays: tuple  # slot_ids, page tables, SamplingRows, adapter slots, drafting flags (None: unused)
    mode: str
    drafting: list[bool] | None = None

    def same_batch(self, slots, page_tables, sampling, loras, drafting=None) -> bool:
        # A request keeps its SamplingParams object, and list equality tries identity first.
        return (
            slots == self.slots
            and page_tables == self.page_tables
            and sampling == self.sampling
            and loras == self.loras
            and drafting == self.drafting
        )

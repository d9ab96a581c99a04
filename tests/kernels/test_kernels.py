"""Pallas kernels against their jnp references (interpret mode on the CPU, compiled on the GPU),
within the tolerance the backend owes (support/precision.py).

Paged attention: every input is random normal. Everything a kernel must not read is poisoned
with NaN: other layers of the cache, pages in no page table, the tail of each
sequence's last page, page-table slots past a sequence's pages (which also point
at NaN pages or far out of range), and q's padding rows. A single stray read
turns the output NaN, so "no NaN and equal to the reference" proves the
kernels read only what they should. The chunked references are checked against
a brute-force loop and against the old gather-everything implementation
(dense_paged_attention), including page tables many times wider than needed.

Skinny matmul: random x and bf16 weights at shapes that hit every masked edge
(ragged N, ragged K, uneven splits, M from 1 to 16).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.dense_paged_attention import dense_decode, dense_extend
from support.precision import EXACT, EXACT_SETTINGS, TF32, emulate_tf32_dots, tolerance

from jspec.kernels.backend import interpret_mode
from jspec.kernels.paged_decode import paged_decode
from jspec.kernels.paged_extend import extend_plan, paged_extend
from jspec.kernels.paged_tiles import (
    TARGET_PROGRAMS,
    choose_splits,
    min_split_len,
    query_block_table,
    runtime_split_len,
)
from jspec.kernels.ref import paged_decode_ref, paged_extend_ref, skinny_matmul_ref
from jspec.kernels.skinny_matmul import skinny_matmul, skinny_matmul_plan

LAYERS = 3
LAYER = 1  # not 0: a kernel that ignores the layer index reads NaN
SM_SCALE = 0.3
FAR_PAGE = 1 << 30


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def paged_problem(rng, seq_lens, *, page_size, num_kv_heads, head_dim, spare_slots=1, dtype=np.float32):
    """A poisoned paged KV cache holding one sequence of each length.

    Returns (k_cache, v_cache, page_tables); only layer LAYER, the pages in the
    tables, and positions below each seq_len hold numbers.
    """
    pages_needed = [-(-n // page_size) for n in seq_lens]
    max_pages = max(pages_needed) + spare_slots
    num_used = sum(pages_needed)
    num_pages = num_used + 3  # three pages that no table uses
    shape = (LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    poison = num_pages - 1
    page_tables = np.full((len(seq_lens), max_pages), poison, np.int32)
    owned = rng.permutation(num_used)  # scattered, not contiguous
    cursor = 0
    for b, (n, pages) in enumerate(zip(seq_lens, pages_needed)):
        table = owned[cursor : cursor + pages]
        cursor += pages
        page_tables[b, :pages] = table
        if b % 2:
            page_tables[b, pages:] = FAR_PAGE  # garbage past the end must not be dereferenced
        for t in range(n):
            page, offset = table[t // page_size], t % page_size
            k[LAYER, page, offset] = rng.standard_normal((num_kv_heads, head_dim))
            v[LAYER, page, offset] = rng.standard_normal((num_kv_heads, head_dim))
    return k.astype(dtype), v.astype(dtype), page_tables


def ragged_queries(rng, q_lens, num_q_heads, head_dim, pad_rows):
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(query_start[-1]) + pad_rows, num_q_heads, head_dim)).astype(np.float32)
    q[query_start[-1] :] = np.nan  # padding rows must not be read
    return q, query_start


def random_tree_mask(rng, batch, max_q_len):
    """A draft-tree style mask: each token sees itself and a random set of earlier tokens."""
    mask = np.tril(rng.random((batch, max_q_len, max_q_len)) < 0.5)
    mask |= np.eye(max_q_len, dtype=bool)[None]
    return mask


def brute_force_attention(q_rows, k, v, seq_lens, page_tables, owners, visible_fn, softcap=None, sinks=None):
    """Loop-by-loop attention in float64 straight from the page table: the check on ref.py itself."""
    _, _, page_size, num_kv_heads, head_dim = k.shape
    out = np.zeros(q_rows.shape, np.float64)
    group = q_rows.shape[1] // num_kv_heads
    for row, owner in enumerate(owners):
        if owner is None:
            continue
        b, i = owner
        positions = [j for j in range(seq_lens[b]) if visible_fn(b, i, j)]
        if not positions:
            continue  # zeros, sink or not: the sink's value is zero
        slots = [(page_tables[b, j // page_size], j % page_size) for j in positions]
        keys = np.stack([k[LAYER, p, o] for p, o in slots]).astype(np.float64)
        vals = np.stack([v[LAYER, p, o] for p, o in slots]).astype(np.float64)
        for h in range(q_rows.shape[1]):
            logits = keys[:, h // group] @ q_rows[row, h].astype(np.float64) * SM_SCALE
            if softcap is not None:
                logits = softcap * np.tanh(logits / softcap)
            sink = [] if sinks is None else [float(sinks[h])]
            top = max([logits.max(), *sink])
            w = np.exp(logits - top)
            total = w.sum() + sum(np.exp(s - top) for s in sink)
            out[row, h] = (w / total) @ vals[:, h // group]
    return out


def test_interpret_mode_follows_backend():
    assert interpret_mode() == (jax.default_backend() != "gpu")


def test_choose_splits_fills_the_gpu_and_respects_bounds():
    # Few programs and a long context: split; many programs: do not.
    splits, split_len = choose_splits(4096, 8, 64, 256, None)
    assert splits > 1 and split_len % 64 == 0 and splits * split_len >= 4096 and split_len >= 256
    assert choose_splits(4096, 4096, 64, 256, None) == (1, 4096)
    assert choose_splits(100, 1, 64, 1, 5) == (2, 64)  # never more splits than tiles


def test_runtime_split_len_follows_the_longest_sequence():
    # An 8192-token table and few programs: many splits, sized for the table.
    num_splits, _ = choose_splits(8192, 8, 64, 256, None)
    floor = min_split_len(64, 256, None)
    assert num_splits > 8 and floor == 256
    split_len = lambda lens, *plan: int(runtime_split_len(jnp.array(lens), *plan)[0])  # noqa: E731
    # A short sequence takes one split of the floor's length; the others have nothing to do.
    assert split_len([100, 0], num_splits, 64, floor) == 256
    # A long one spreads over every split, in whole tiles.
    long = split_len([8000, 3], num_splits, 64, floor)
    assert long % 64 == 0 and num_splits * long >= 8000 > (num_splits - 1) * long
    # Without the floor's help: the longest sequence over all splits, rounded to tiles.
    assert split_len([3000, 9], 16, 64, 64) == 192
    # An explicit num_splits keeps all its splits busy: only the tile bounds them below.
    assert split_len([100], 4, 16, min_split_len(16, 256, 4)) == 32


def test_references_match_brute_force():
    rng = np.random.default_rng(0)
    seq_lens = np.array([5, 0, 8, 3], np.int32)
    q_lens = np.array([3, 0, 4, 1])
    k, v, tables = paged_problem(rng, seq_lens, page_size=4, num_kv_heads=2, head_dim=8)
    q, query_start = ragged_queries(rng, q_lens, 4, 8, pad_rows=2)
    mask = random_tree_mask(rng, 4, 4)
    owners = [None] * q.shape[0]
    for b in range(4):
        for i in range(q_lens[b]):
            owners[query_start[b] + i] = (b, i)

    def causal(b, i, j):
        return j <= seq_lens[b] - q_lens[b] + i

    def tree(b, i, j):
        prefix = seq_lens[b] - q_lens[b]
        return j < prefix or mask[b, i, j - prefix]

    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    tol = tolerance(dots="exact")
    for visible_fn, m in ((causal, None), (tree, mask)):
        got = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=4, mask=m)
        want = brute_force_attention(q, k, v, seq_lens, tables, owners, visible_fn)
        assert rel_err(got, want) < tol.rel

    q_dec = q[:4]
    got = paged_decode_ref(q_dec, k, v, jnp.int32(LAYER), seq_lens, tables, sm_scale=SM_SCALE)
    want = brute_force_attention(q_dec, k, v, seq_lens, tables, [(b, 0) for b in range(4)], lambda b, i, j: True)
    assert rel_err(got, want) < tol.rel
    assert not np.any(np.asarray(got[1]))  # seq_len 0 -> zeros


# (page_size, kv_chunk, wide, tree): a table narrower than one chunk, several chunks
# per sequence, a page longer than a chunk; tables `wide` times the pages needed.
ORACLE_CASES = [
    pytest.param(1, 256, 1, False, id="s1-table_under_chunk-causal"),
    pytest.param(16, 32, 16, True, id="s16-chunk32-wide16-tree"),
    pytest.param(64, 16, 8, False, id="s64-page_over_chunk-wide8-causal"),
]


@pytest.mark.parametrize("page_size,kv_chunk,wide,tree", ORACLE_CASES)
def test_references_match_dense_oracle(page_size, kv_chunk, wide, tree):
    """The chunked references equal the gather-everything oracle, whatever the table width."""
    rng = np.random.default_rng(page_size + kv_chunk + wide)
    num_kv_heads, group, head_dim, max_q_len = 2, 3, 16, 8
    # A qlen-0 sequence with KV between real ones, a whole prefill, lengths from 1 to
    # 150-odd tokens, and two padding sequences (qlen 0, the last with no KV) at the end.
    q_lens = np.array([3, 0, 8, 1, 5, 0, 0])
    prefix = np.array([150, 40, 0, 3, 64, 20, 0])
    seq_lens = (prefix + q_lens).astype(np.int32)
    needed = -(-int(seq_lens.max()) // page_size)
    k, v, tables = paged_problem(
        rng,
        seq_lens,
        page_size=page_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        spare_slots=(wide - 1) * needed,
    )
    assert tables.shape[1] == wide * needed
    q, query_start = ragged_queries(rng, q_lens, num_kv_heads * group, head_dim, pad_rows=3)
    layer = jnp.int32(LAYER)

    q_dec = q[: len(seq_lens)]
    dec_args = (q_dec, k, v, layer, seq_lens, tables)
    tol = tolerance(dots="exact")
    want_out, want_lse = dense_decode(*dec_args, sm_scale=SM_SCALE, return_lse=True)
    got = paged_decode_ref(*dec_args, sm_scale=SM_SCALE, kv_chunk=kv_chunk)
    assert got.dtype == q.dtype and rel_err(got, want_out) < tol.rel
    out, lse = paged_decode_ref(*dec_args, sm_scale=SM_SCALE, kv_chunk=kv_chunk, return_lse=True)
    assert rel_err(out, want_out) < tol.rel
    np.testing.assert_allclose(lse, want_lse, rtol=tol.rtol, atol=tol.lse_atol)
    assert np.all(np.isneginf(lse[-1])) and not np.any(np.asarray(out[-1]))  # seq_len 0

    ext_args = (q, k, v, layer, seq_lens, tables, query_start)
    mask = random_tree_mask(rng, len(seq_lens), max_q_len) if tree else None
    got = np.asarray(paged_extend_ref(*ext_args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, kv_chunk=kv_chunk))
    want = dense_extend(*ext_args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    assert not np.isnan(got).any()
    assert rel_err(got, want) < tol.rel
    assert not np.any(got[query_start[-1] :])  # padding rows are zeros


# (page_size, group, head_dim, tuning): every page size, GQA ratio and head dim
# appears; splits 1 (the direct-write path) and several (the merge path); tiles
# smaller than, equal to and larger than a page.
DECODE_CASES = [
    pytest.param(1, 1, 64, dict(block_n=16), id="s1-g1-d64-auto_splits"),
    pytest.param(16, 4, 128, dict(block_n=32, num_splits=1), id="s16-g4-d128-one_split"),
    pytest.param(64, 8, 64, dict(block_n=16, num_splits=3), id="s64-g8-d64-tile_in_page"),
    pytest.param(16, 8, 128, dict(block_n=64, num_splits=2), id="s16-g8-d128-tile_spans_pages"),
    pytest.param(4, 3, 64, dict(block_n=16, num_splits=2), id="s4-g3-d64-group_not_pow2"),
]


@pytest.mark.parametrize("page_size,group,head_dim,tuning", DECODE_CASES)
def test_paged_decode_matches_reference(page_size, group, head_dim, tuning):
    rng = np.random.default_rng(page_size * 100 + group)
    num_kv_heads = 2
    # Lengths: empty, one token, exactly on a page boundary, just past one, longer.
    seq_lens = np.array([0, 1, 2 * page_size, 2 * page_size + 3, 5 * page_size // 2 + 37], np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q = rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim)).astype(np.float32)
    args = (q, k, v, jnp.array([LAYER], jnp.int32), seq_lens, tables)
    out = paged_decode(*args, sm_scale=SM_SCALE, min_split_tokens=16, **tuning)
    ref = paged_decode_ref(*args, sm_scale=SM_SCALE)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < tolerance().rel
    assert not np.any(np.asarray(out[0]))  # seq_len 0 -> zeros


# (page_size, group, head_dim, tree, tuning)
EXTEND_CASES = [
    pytest.param(16, 4, 64, False, dict(block_m=32, block_n=16, num_splits=1), id="s16-g4-d64-causal"),
    pytest.param(1, 8, 128, True, dict(block_m=16, block_n=32, num_splits=1), id="s1-g8-d128-tree"),
    pytest.param(64, 1, 128, False, dict(block_m=16, block_n=32, num_splits=3), id="s64-g1-d128-causal-split"),
    pytest.param(16, 4, 64, True, dict(block_m=32, block_n=16, num_splits=2), id="s16-g4-d64-tree-split"),
    pytest.param(16, 2, 64, False, dict(min_split_tokens=16), id="s16-g2-d64-causal-defaults"),
    # 16 rows hold 5 tokens of 3 heads: the 16th row is padding inside the block.
    pytest.param(4, 3, 64, True, dict(block_m=16, block_n=16, num_splits=1), id="s4-g3-d64-tree-group_not_pow2"),
]


@pytest.mark.parametrize("page_size,group,head_dim,tree,tuning", EXTEND_CASES)
def test_paged_extend_matches_reference(page_size, group, head_dim, tree, tuning):
    rng = np.random.default_rng(page_size * 100 + group + 7 * tree)
    num_kv_heads, max_q_len = 2, 8
    # qlen 0 with and without KV, a whole prefill (no prefix), a prefix ending on
    # a page boundary, a total ending on one, a single token, and a ragged one.
    q_lens = np.array([0, 5, 0, 8, 3, 1, 7])
    prefix = np.array([0, 0, 2 * page_size + 1, page_size, max(2 * page_size - 3, 0), page_size + 1, 3 * page_size - 2])
    seq_lens = (prefix + q_lens).astype(np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q, query_start = ragged_queries(rng, q_lens, num_kv_heads * group, head_dim, pad_rows=5)
    mask = random_tree_mask(rng, len(seq_lens), max_q_len) if tree else None
    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    out = paged_extend(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, **tuning)
    ref = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    out = np.asarray(out)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(out).any()
    assert rel_err(out, ref) < tolerance().rel
    assert not np.any(out[query_start[-1] :])  # padding rows are zeros


def test_query_block_table_holds_every_block_of_any_ragged_batch():
    """The extend grid's table, for ragged batches up to the plan's bound (a mixed step: many
    one-token rows beside a long prompt; a uniform tree verify; empty rows): every (sequence,
    block) a query needs exactly once, each sequence's highest block first, the rest -1."""
    rng = np.random.default_rng(3)
    batches = [np.array([0] * 3 + [1] * 60 + [192]), np.full(32, 8), np.array([0, 0, 0]), rng.integers(0, 40, 50)]
    for q_lens in batches:
        num_rows = int(q_lens.sum()) + 7  # padded, as the worker pads T
        plan = extend_plan(len(q_lens), 32, (1, 2, 16, 8, 128), 64, max(int(q_lens.max()), 1), num_rows)
        tokens = plan.block_m // 4
        seq, block = map(np.asarray, query_block_table(jnp.asarray(q_lens), tokens, plan.num_items))
        need = [(b, j) for b, n in enumerate(q_lens) for j in reversed(range(-(-n // tokens)))]
        assert plan.num_items <= len(q_lens) * plan.num_q_blocks and len(need) <= plan.num_items
        assert list(zip(seq[: len(need)].tolist(), block[: len(need)].tolist())) == need
        assert (seq[len(need) :] == -1).all()


SMOLLM2_CACHE = (1, 64, 16, 3, 64)  # 9 query heads over 3 kv heads of 64, pages of 16


def test_extend_plan_puts_enough_programs_first_for_short_queries():
    """A short verify at small batch: query blocks shrink and splits may be one tile long until
    the grid fills the GPU (the SmolLM2 shape over a 512-token table); long prefill and a batch
    whose blocks already fill a wave keep the smallest block that holds every row."""
    plan = lambda b, q, **kw: extend_plan(b, 9, SMOLLM2_CACHE, 32, q, b * q, **kw)  # noqa: E731
    tiles = lambda p: (p.block_m, p.num_items, p.num_splits, p.min_split_len)  # noqa: E731
    # B=1: 16-row blocks (5 tokens x 3 heads), the 512 tokens in four one-tile splits.
    assert tiles(plan(1, 16)) == (16, 4, 4, 128)
    assert tiles(plan(1, 8)) == (16, 2, 4, 128)
    assert tiles(plan(1, 4)) == (16, 1, 4, 128)
    # B=16: 16-row blocks (64 x 3 programs) would pass a wave of SMs; 32-row ones do not.
    assert tiles(plan(16, 16)) == (32, 32, 4, 128)
    # A wave already at 64-row blocks: unchanged, splits of at least 256 tokens.
    assert tiles(plan(64, 16)) == (64, 64, 2, 256)
    # Long prefill: 128-row blocks, 8 warps, splits of at least 256 tokens.
    long = plan(1, 512)
    assert (long.block_m, long.num_warps, long.num_splits, long.min_split_len) == (128, 8, 2, 256)
    assert tiles(plan(4, 512)) == (128, 52, 2, 256)
    # A served table spans the context (8,192 tokens) while sequences hold far less: the static
    # splits stay under the target grid (rounded down), not one past it per tile of the table.
    served = lambda b, q: extend_plan(b, 9, SMOLLM2_CACHE, 512, q, b * q)  # noqa: E731
    assert tiles(served(1, 16)) == (16, 4, 32, 128)  # 12 programs a split: 32 x 12 <= 4 waves
    assert tiles(served(16, 16)) == (32, 32, 4, 128)
    assert served(1, 16).num_splits * 4 * 3 <= TARGET_PROGRAMS < 2 * 32 * 4 * 3
    # Explicit arguments win.
    assert plan(1, 16, block_m=64).block_m == 64
    assert tiles(plan(1, 16, num_splits=2)) == (16, 4, 2, 128)
    assert tiles(plan(1, 16, min_split_tokens=256)) == (16, 4, 2, 256)
    # Never below the GQA group: 32 query heads over one kv head.
    assert extend_plan(1, 32, (1, 64, 16, 1, 64), 32, 2, 2).block_m == 32


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_paged_extend_small_batch_plan_matches_reference(tree):
    """The automatic plan for a short ragged verify at small batch (16-row blocks of 5 tokens x 3
    heads, several one-tile splits of a 300-token context) against the reference."""
    rng = np.random.default_rng(53 + tree)
    max_q_len = 8
    q_lens = np.array([7, 0, 3, 1])
    seq_lens = (np.array([293, 40, 130, 5]) + q_lens).astype(np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=16, num_kv_heads=3, head_dim=64, spare_slots=13)
    q, query_start = ragged_queries(rng, q_lens, 9, 64, pad_rows=5)
    plan = extend_plan(len(q_lens), 9, k.shape, tables.shape[1], max_q_len, q.shape[0])
    assert (plan.block_m, plan.num_splits, plan.min_split_len) == (16, 4, 128)
    mask = random_tree_mask(rng, len(seq_lens), max_q_len) if tree else None
    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    out = np.asarray(paged_extend(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask))
    ref = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    assert not np.isnan(out).any()
    assert rel_err(out, ref) < tolerance().rel
    assert not np.any(out[query_start[-1] :])  # padding rows are zeros


# Page tables 8x wider than the longest sequence needs (the columns past each
# sequence's pages poisoned) and lengths from 0 to 300 tokens in one batch: the
# runtime split length spreads the longest over the splits, and splits past a
# sequence's end read nothing.
WIDE_DECODE_CASES = [
    pytest.param(16, dict(block_n=16, min_split_tokens=16), id="s16-many_splits"),
    pytest.param(1, dict(block_n=32, return_lse=True), id="s1-default_min_split-lse"),
]


@pytest.mark.parametrize("page_size,tuning", WIDE_DECODE_CASES)
def test_paged_decode_wide_table(page_size, tuning):
    rng = np.random.default_rng(31 + page_size)
    seq_lens = np.array([0, 300, 3, 17, 1, 64], np.int32)
    needed = -(-300 // page_size)
    k, v, tables = paged_problem(
        rng, seq_lens, page_size=page_size, num_kv_heads=2, head_dim=64, spare_slots=7 * needed
    )
    q = rng.standard_normal((len(seq_lens), 8, 64)).astype(np.float32)
    args = (q, k, v, jnp.array([LAYER], jnp.int32), seq_lens, tables)
    tuning = dict(tuning)
    return_lse = tuning.pop("return_lse", False)
    out = paged_decode(*args, sm_scale=SM_SCALE, return_lse=return_lse, **tuning)
    ref = paged_decode_ref(*args, sm_scale=SM_SCALE, return_lse=return_lse)
    tol = tolerance()
    if return_lse:
        (out, lse), (ref, ref_lse) = out, ref
        np.testing.assert_allclose(lse, ref_lse, rtol=tol.rtol, atol=tol.lse_atol)
        assert np.all(np.isneginf(lse[0]))
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, ref) < tol.rel
    assert not np.any(np.asarray(out[0]))  # seq_len 0 -> zeros


@pytest.mark.parametrize(
    "page_size,tree,tuning",
    [
        pytest.param(16, False, dict(block_n=16, min_split_tokens=32), id="s16-causal-many_splits"),
        pytest.param(64, True, dict(block_n=32, num_splits=3), id="s64-tree-explicit_splits"),
    ],
)
def test_paged_extend_wide_table(page_size, tree, tuning):
    rng = np.random.default_rng(41 + page_size + tree)
    max_q_len = 8
    # A long prefix, a qlen-0 sequence with KV, a whole prefill, one token, and padding sequences.
    q_lens = np.array([3, 0, 8, 1, 0, 0])
    prefix = np.array([250, 40, 0, 5, 20, 0])
    seq_lens = (prefix + q_lens).astype(np.int32)
    needed = -(-int(seq_lens.max()) // page_size)
    k, v, tables = paged_problem(
        rng, seq_lens, page_size=page_size, num_kv_heads=2, head_dim=64, spare_slots=7 * needed
    )
    q, query_start = ragged_queries(rng, q_lens, 4, 64, pad_rows=5)
    mask = random_tree_mask(rng, len(seq_lens), max_q_len) if tree else None
    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    out = np.asarray(paged_extend(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, **tuning))
    ref = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    assert not np.isnan(out).any()
    assert rel_err(out, ref) < tolerance().rel
    assert not np.any(out[query_start[-1] :])  # padding rows are zeros


def test_tree_mask_changes_the_result():
    """The tree path really reads the mask: a non-causal mask gives a different answer."""
    rng = np.random.default_rng(3)
    seq_lens = np.array([12, 9], np.int32)
    q_lens = np.array([4, 4])
    k, v, tables = paged_problem(rng, seq_lens, page_size=4, num_kv_heads=1, head_dim=64)
    q, query_start = ragged_queries(rng, q_lens, 4, 64, pad_rows=0)
    chain = np.broadcast_to(np.eye(4, dtype=bool), (2, 4, 4))  # each token sees only itself
    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    tree_out = paged_extend(*args, sm_scale=SM_SCALE, max_q_len=4, mask=chain, block_n=16)
    causal_out = paged_extend(*args, sm_scale=SM_SCALE, max_q_len=4, block_n=16)
    ref = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=4, mask=chain)
    assert rel_err(tree_out, ref) < tolerance().rel
    assert rel_err(tree_out, causal_out) > 1e-2


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_equals_extend_with_one_token(page_size):
    rng = np.random.default_rng(11 + page_size)
    seq_lens = np.array([0, 17, 32, 40], np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=2, head_dim=64)
    q = rng.standard_normal((4, 8, 64)).astype(np.float32)
    query_start = np.arange(5, dtype=np.int32)
    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables)
    decoded = paged_decode(*args, sm_scale=SM_SCALE, block_n=16, num_splits=2)
    extended = paged_extend(*args, query_start, sm_scale=SM_SCALE, max_q_len=1, block_n=16)
    # Both kernels round the same q, k and v; their softmax weights differ in the last bits.
    assert rel_err(decoded, extended) < tolerance().rel
    ref_decoded = paged_decode_ref(*args, sm_scale=SM_SCALE)
    ref_extended = paged_extend_ref(*args, query_start, sm_scale=SM_SCALE, max_q_len=1)
    assert rel_err(ref_decoded, ref_extended) < tolerance(dots="exact").rel / 10  # the same sums, reordered


def float32_decode_and_extend():
    """A decode and a tree extend over float32 KV: ((kernel, reference), (kernel, reference))."""
    rng = np.random.default_rng(13)
    seq_lens = np.array([40, 7, 0, 29], np.int32)
    q_lens = np.array([3, 1, 0, 4])
    k, v, tables = paged_problem(rng, seq_lens, page_size=4, num_kv_heads=2, head_dim=64)
    q_dec = rng.standard_normal((4, 8, 64)).astype(np.float32)
    q, query_start = ragged_queries(rng, q_lens, 8, 64, pad_rows=2)
    mask = random_tree_mask(rng, 4, 4)
    dec = (q_dec, k, v, jnp.int32(LAYER), seq_lens, tables)
    ext = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    real = slice(0, int(query_start[-1]))
    return (
        (paged_decode(*dec, sm_scale=SM_SCALE, block_n=16, num_splits=2), paged_decode_ref(*dec, sm_scale=SM_SCALE)),
        (
            paged_extend(*ext, sm_scale=SM_SCALE, max_q_len=4, mask=mask, block_n=16)[real],
            paged_extend_ref(*ext, sm_scale=SM_SCALE, max_q_len=4, mask=mask)[real],
        ),
    )


def test_float32_kernels_at_highest_precision_match_tightly():
    """With jax_default_matmul_precision at highest the kernels' float32 dots are float32 on
    every backend (IEEE in Triton), and the float32 tolerance is the tight one everywhere."""
    with jax.default_matmul_precision("highest"):
        assert tolerance() == EXACT
        for out, ref in float32_decode_and_extend():
            assert rel_err(out, ref) < EXACT.rel


def test_tf32_rounding_is_what_the_gpu_tolerance_allows():
    """Rounded to TF32 (the GPU's own dots, emulated elsewhere), the kernels' float32 operands move
    the result past the tight tolerance and well inside the TF32 one: that tolerance has TF32's
    size, not more."""
    if jax.config.jax_default_matmul_precision in EXACT_SETTINGS:
        pytest.skip("jax_default_matmul_precision asks for float32 dots")
    emulated = contextlib.nullcontext() if jax.default_backend() == "gpu" else emulate_tf32_dots()
    with emulated:
        assert tolerance() == TF32
        for out, ref in float32_decode_and_extend():
            assert EXACT.rel < rel_err(out, ref) < TF32.rel / 2


def test_bfloat16_inputs():
    """bf16 in, bf16 out, f32 softmax: close to the f32 reference at bf16 precision."""
    rng = np.random.default_rng(5)
    seq_lens = np.array([30, 64], np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=16, num_kv_heads=2, head_dim=64)
    q = rng.standard_normal((2, 8, 64)).astype(np.float32)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    args = (jnp.int32(LAYER), seq_lens, tables)
    out = paged_decode(bf(q), bf(k), bf(v), *args, sm_scale=SM_SCALE, block_n=32)
    ref = paged_decode_ref(
        bf(q).astype(jnp.float32), bf(k).astype(jnp.float32), bf(v).astype(jnp.float32), *args, sm_scale=SM_SCALE
    )
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, ref) < tolerance(jnp.bfloat16).rel


@pytest.mark.parametrize(
    "M,K,N,tuning",
    [
        (1, 512, 384, {}),
        (5, 256, 1000, dict(block_n=64)),  # ragged N: the last strip is masked
        (16, 512, 256, dict(block_k=64, num_splits=4)),
        (3, 300, 200, dict(block_n=32, block_k=32, num_splits=3)),  # ragged K and N, uneven splits
        (1, 1024, 128, dict(block_k=64, num_splits=16)),  # one tile per split
        (7, 128, 64, dict(num_splits=1, num_stages=4)),
    ],
)
def test_skinny_matmul_matches_reference(M, K, N, tuning):
    """f32 x against bf16 weights; only the summation order differs from the reference."""
    rng = np.random.default_rng(M * 1000 + N)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)), jnp.bfloat16)
    out = skinny_matmul(x, w, **tuning)
    ref = skinny_matmul_ref(x, w)
    assert out.shape == (M, N) and out.dtype == jnp.float32
    # Both cast x to bf16, whose products are exact in f32 on every backend; the sums of K terms
    # of size ~sqrt(K) differ by rounding only.
    tol = tolerance(dots="exact")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=tol.rtol, atol=tol.atol * np.sqrt(K))


def test_skinny_matmul_plan():
    """Splits fill the GPU for narrow N, never go below MIN_TILES_PER_SPLIT tiles, and tile K exactly."""
    qkv, lm_head, down = (
        skinny_matmul_plan(1, 4096, 6144),
        skinny_matmul_plan(1, 4096, 128256),
        skinny_matmul_plan(1, 14336, 4096),
    )
    assert lm_head.num_splits == 1  # 1002 strips are already enough programs
    assert qkv.num_splits == 8 and qkv.split_len == 512
    assert down.num_splits * down.split_len >= 14336 > (down.num_splits - 1) * down.split_len
    tiny = skinny_matmul_plan(4, 64, 48)
    assert (tiny.block_n, tiny.block_k, tiny.num_splits) == (64, 64, 1)
    with pytest.raises(ValueError):
        skinny_matmul_plan(17, 64, 64)
    with pytest.raises(ValueError):
        skinny_matmul_plan(1, 64, 64, block_n=96)


def test_dense_matmul_switch(monkeypatch):
    """JSPEC_SKINNY_MATMUL picks the projections' matmul; a bad value is refused, and off
    the GPU the XLA dot runs whatever it says (the kernel lowers through Triton only there)."""
    from jspec.layers import matmul

    x = jax.random.normal(jax.random.key(0), (3, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 48), jnp.bfloat16)
    monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, "cublas")
    with pytest.raises(ValueError, match="expected 'auto', 'xla', 'xla_padded', 'pallas', 'mosaic' or 'xla_nk'"):
        matmul.dense_f32(x, w)
    for backend in ("auto", "pallas", "mosaic", "xla_padded"):
        monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, backend)
        np.testing.assert_array_equal(matmul.dense_f32(x, w), jnp.dot(x, w, preferred_element_type=jnp.float32))
    one_row = jnp.dot(x[:1], w, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(matmul.two_row_dot(x[:1], w), one_row, rtol=1e-6)


def test_one_row_products_of_large_weights_run_as_two_rows_on_one_gpu(monkeypatch):
    """auto (the default) pads a one-row product to two rows for a weight of at least
    PADDED_MIN_WEIGHT_ELEMENTS on one GPU, and leaves smaller weights, more rows and other
    settings to XLA's dot (read off the lowered programs: a pad is there or not)."""
    from jspec.layers import matmul

    monkeypatch.setattr(matmul, "one_gpu", lambda: True)
    monkeypatch.delenv(matmul.SKINNY_MATMUL_ENV, raising=False)
    n = matmul.PADDED_MIN_WEIGHT_ELEMENTS // 1024

    def padded(rows, out, backend=None):
        if backend:
            monkeypatch.setenv(matmul.SKINNY_MATMUL_ENV, backend)
        x = jax.ShapeDtypeStruct((rows, 1024), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((1024, out), jnp.bfloat16)
        traced_afresh = jax.jit(lambda x, w: matmul.dense_f32(x, w))  # a new function: reads the setting
        return "stablehlo.pad" in traced_afresh.lower(x, w).as_text()

    assert padded(1, n) and not padded(1, n - 64) and not padded(2, n)
    assert not padded(1, n, "xla") and padded(1, 64, "xla_padded")


# Sliding windows: (window, page_size, tree, tuning). A window shorter than a block's tokens
# (so its low edge cuts through the block), one longer than most prefixes, splits over it.
WINDOW_CASES = [
    pytest.param(3, 4, False, dict(block_m=16, block_n=16, num_splits=1), id="w3-s4-causal-window_in_block"),
    pytest.param(37, 16, False, dict(block_m=32, block_n=16, num_splits=3), id="w37-s16-causal-split"),
    pytest.param(9, 1, True, dict(block_m=16, block_n=16, num_splits=2), id="w9-s1-tree-split"),
    pytest.param(100, 16, True, dict(block_m=32, block_n=32, num_splits=1), id="w100-s16-tree"),
]


@pytest.mark.parametrize("window,page_size,tree,tuning", WINDOW_CASES)
def test_sliding_window_kernels_match_reference_and_brute_force(window, page_size, tree, tuning):
    rng = np.random.default_rng(window + page_size)
    num_kv_heads, group, head_dim, max_q_len = 2, 2, 64, 8
    q_lens = np.array([5, 0, 8, 1, 3, 0])
    prefix = np.array([70, 30, 0, 130, 2, 0])
    seq_lens = (prefix + q_lens).astype(np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q, query_start = ragged_queries(rng, q_lens, num_kv_heads * group, head_dim, pad_rows=3)
    mask = random_tree_mask(rng, len(seq_lens), max_q_len) if tree else None
    w = jnp.int32(window)
    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    out = np.asarray(paged_extend(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, window=w, **tuning))
    ref = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, window=w, kv_chunk=32)
    owners = [None] * q.shape[0]
    for b in range(len(seq_lens)):
        for i in range(q_lens[b]):
            owners[query_start[b] + i] = (b, i)

    def visible(b, i, j):
        start = seq_lens[b] - q_lens[b]
        if mask is None:
            return start + i - window < j <= start + i
        depth = int(mask[b, i].sum()) - 1
        return start + depth - window < j < start or (j >= start and mask[b, i, j - start])

    want = brute_force_attention(q, k, v, seq_lens, tables, owners, visible)
    tol, ref_tol = tolerance(), tolerance(dots="exact")
    assert not np.isnan(out).any()
    assert rel_err(ref, want) < ref_tol.rel
    assert rel_err(out, want) < tol.rel
    unwindowed = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    assert rel_err(unwindowed, want) > 1e-2  # the window hides something here

    q_dec = rng.standard_normal((len(seq_lens), num_kv_heads * group, head_dim)).astype(np.float32)
    dec_args = (q_dec, k, v, jnp.int32(LAYER), seq_lens, tables)
    want = brute_force_attention(
        q_dec, k, v, seq_lens, tables, [(b, 0) for b in range(len(seq_lens))], lambda b, i, j: j >= seq_lens[b] - window
    )
    ref = paged_decode_ref(*dec_args, sm_scale=SM_SCALE, window=w, kv_chunk=32)
    dec_tuning = dict(block_n=tuning["block_n"], num_splits=tuning.get("num_splits"), min_split_tokens=16)
    out = paged_decode(*dec_args, sm_scale=SM_SCALE, window=w, **dec_tuning)
    assert rel_err(ref, want) < ref_tol.rel and rel_err(out, want) < tol.rel
    out, lse = paged_decode(*dec_args, sm_scale=SM_SCALE, window=w, return_lse=True, **dec_tuning)
    ref, ref_lse = paged_decode_ref(*dec_args, sm_scale=SM_SCALE, window=w, return_lse=True)
    assert rel_err(out, ref) < tol.rel
    np.testing.assert_allclose(lse, ref_lse, rtol=tol.rtol, atol=tol.lse_atol)


@pytest.mark.parametrize("tree", [False, True])
def test_logit_softcap_kernels_match_reference_and_brute_force(tree):
    """Gemma 2's attention logit soft-capping (with a window, as its sliding layers have)."""
    rng = np.random.default_rng(17 + tree)
    cap, max_q_len = 0.5, 4
    q_lens = np.array([4, 1, 3])
    prefix = np.array([20, 9, 0])
    seq_lens = (prefix + q_lens).astype(np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=4, num_kv_heads=2, head_dim=64)
    q, query_start = ragged_queries(rng, q_lens, 4, 64, pad_rows=2)
    q *= 4  # logits well past the cap
    mask = random_tree_mask(rng, 3, max_q_len) if tree else None
    owners = [None] * q.shape[0]
    for b in range(3):
        for i in range(q_lens[b]):
            owners[query_start[b] + i] = (b, i)

    def visible(b, i, j):
        start = seq_lens[b] - q_lens[b]
        return j < start or (mask[b, i, j - start] if tree else j <= start + i)

    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    kw = dict(sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, logit_softcap=cap)
    want = brute_force_attention(q, k, v, seq_lens, tables, owners, visible, softcap=cap)
    tol, ref_tol = tolerance(), tolerance(dots="exact")
    assert rel_err(paged_extend_ref(*args, **kw), want) < ref_tol.rel
    assert rel_err(paged_extend(*args, block_m=16, block_n=16, num_splits=2, **kw), want) < tol.rel
    assert rel_err(paged_extend_ref(*args, **{**kw, "logit_softcap": None}), want) > 1e-2
    dec = (q[:3], k, v, jnp.int32(LAYER), seq_lens, tables)
    want = brute_force_attention(q[:3], k, v, seq_lens, tables, [(b, 0) for b in range(3)], lambda *_: True, cap)
    assert rel_err(paged_decode_ref(*dec, sm_scale=SM_SCALE, logit_softcap=cap), want) < ref_tol.rel
    out = paged_decode(*dec, sm_scale=SM_SCALE, logit_softcap=cap, block_n=16, num_splits=2, min_split_tokens=16)
    assert rel_err(out, want) < tol.rel


@pytest.mark.parametrize("tree", [False, True])
def test_attention_sinks_kernels_match_reference_and_brute_force(tree):
    """gpt-oss's per-head sink logits join the softmax's denominator (with a window, as its
    sliding layers have, and split-K, so that the merge must count each sink once)."""
    rng = np.random.default_rng(23 + tree)
    window, max_q_len = 6, 4
    q_lens = np.array([4, 1, 3])
    prefix = np.array([20, 9, 0])
    seq_lens = (prefix + q_lens).astype(np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=4, num_kv_heads=2, head_dim=64)
    q, query_start = ragged_queries(rng, q_lens, 4, 64, pad_rows=2)
    sinks = jnp.asarray([2.0, -1.0, 0.5, 4.0], jnp.float32)  # 4.0 outweighs most keys
    mask = random_tree_mask(rng, 3, max_q_len) if tree else None
    owners = [None] * q.shape[0]
    for b in range(3):
        for i in range(q_lens[b]):
            owners[query_start[b] + i] = (b, i)

    def visible(b, i, j):
        start = seq_lens[b] - q_lens[b]
        if tree:
            depth = int(mask[b, i].sum()) - 1
            return start + depth - window < j < start or (j >= start and mask[b, i, j - start])
        return start + i - window < j <= start + i

    args = (q, k, v, jnp.int32(LAYER), seq_lens, tables, query_start)
    kw = dict(sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask, window=jnp.int32(window), sinks=sinks)
    want = brute_force_attention(q, k, v, seq_lens, tables, owners, visible, sinks=np.asarray(sinks))
    tol, ref_tol = tolerance(), tolerance(dots="exact")
    assert rel_err(paged_extend_ref(*args, **kw), want) < ref_tol.rel
    assert rel_err(paged_extend(*args, block_m=16, block_n=16, num_splits=2, **kw), want) < tol.rel
    assert rel_err(paged_extend_ref(*args, **{**kw, "sinks": None}), want) > 1e-2
    dec = (q[:3], k, v, jnp.int32(LAYER), seq_lens, tables)
    want = brute_force_attention(
        q[:3], k, v, seq_lens, tables, [(b, 0) for b in range(3)], lambda *_: True, sinks=np.asarray(sinks)
    )
    assert rel_err(paged_decode_ref(*dec, sm_scale=SM_SCALE, sinks=sinks), want) < ref_tol.rel
    split = dict(block_n=16, num_splits=2, min_split_tokens=16)
    assert rel_err(paged_decode(*dec, sm_scale=SM_SCALE, sinks=sinks, **split), want) < tol.rel
    assert rel_err(paged_decode(*dec, sm_scale=SM_SCALE, sinks=sinks, block_n=16, num_splits=1), want) < tol.rel

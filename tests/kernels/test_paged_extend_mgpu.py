"""The Mosaic GPU paged extend / tree verify kernel: run by Mosaic GPU's interpreter on the CPU
against the reference, lowered for CUDA on the CPU at Llama-3.1-8B's shapes, its block layout
checked without the kernel, and refusing by name what it does not cover.

As in test_paged_decode_mgpu.py: the interpreter runs on the poisoned problems of test_kernels.py
(NaN wherever nothing may be read: other layers, pages in no table, the tail of each sequence's
last page, table slots past a sequence's pages, q's padding rows) with its race detector on, so
"no NaN, no race, equal to the reference" checks the pipeline's synchronisation and the masks
alike. Interpreted cases cost seconds each (mostly tracing), so they are few and small, chosen
so that every program runs unmasked and masked tiles, and the pipeline crosses from one loop
to the other.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The race detector's verdict has no public name in jax 0.11.2.
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels.test_kernels import LAYER, SM_SCALE, paged_problem, ragged_queries, rel_err
from support.lowering import lower_for_cuda
from support.precision import tolerance
from support.tree import BATCH, VOCAB, pipeline, random_draft

from jspec.kernels.backend import interpret_mode
from jspec.kernels.mgpu_tiles import GROUP_ROWS
from jspec.kernels.paged_decode_mgpu import MosaicUnsupported
from jspec.kernels.paged_extend_mgpu import (
    MAX_TREE_TOKENS,
    mosaic_extend_plan,
    mosaic_extend_unsupported,
    paged_extend_mgpu,
    query_blocks,
    ragged_rows,
)
from jspec.kernels.ref import paged_extend_ref

BF16, I32 = jnp.bfloat16, jnp.int32
RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)


def draft_tree_mask(rng, nodes: int, max_q_len: int) -> np.ndarray:
    """A verify step's mask: the draft tree of the speculative pipeline (top-2 over three steps,
    `nodes` nodes, support/tree.py) for each of its BATCH requests, padded with zeros to
    max_q_len as verify pads it to its bucket."""
    target = rng.integers(0, VOCAB, size=(BATCH, nodes), dtype=np.int32)
    _, _, tree, _ = pipeline(2, 3, nodes)(*random_draft(rng, 2, 3), target)
    mask = np.zeros((BATCH, max_q_len, max_q_len), bool)
    mask[:, :nodes, :nodes] = np.asarray(tree.mask)
    return mask


# (page_size, num_kv_heads, group, head_dim, tree, q_lens, prefixes, tuning), with few programs
# and tiles each (the interpreter runs the kernel op by op on the host). Causal: a group of 3 (21
# tokens and a padding row per block), one sequence over three query blocks, prefixes on and off
# page and tile boundaries. Tree: the pipeline's draft trees of 6 nodes padded to 8 (one request
# verifying only its first nodes, one none, one without a prefix), pages of 8, two kv heads, two
# splits of two tiles whose pipeline (three tiles in flight) crosses from unmasked to masked
# tiles, a split with nothing to read. Causal in 128-token pages: tiles inside a page, a 64-token
# query block (group 1) and a second one, two splits.
CASES = [
    pytest.param(16, 1, 3, 64, False, [0, 5, 50, 16], [7, 0, 70, 120], {}, id="s16-g3-d64-causal"),
    pytest.param(
        8,
        2,
        4,
        64,
        True,
        [6, 0, 3, 6],
        [200, 40, 77, 0],
        dict(num_splits=2, num_stages=3),
        id="s8-g4-d64-tree-two_splits",
    ),
    pytest.param(128, 1, 1, 64, False, [70, 2], [150, 256], dict(num_splits=2), id="s128-g1-d64-causal-two_splits"),
]


@pytest.mark.parametrize("page_size,num_kv_heads,group,head_dim,tree,q_lens,prefixes,tuning", CASES)
def test_interpreted_kernel_matches_reference(page_size, num_kv_heads, group, head_dim, tree, q_lens, prefixes, tuning):
    rng = np.random.default_rng(page_size + group)
    q_lens, prefixes = np.array(q_lens), np.array(prefixes)
    max_q_len = 8 if tree else int(q_lens.max())
    seq_lens = (prefixes + q_lens).astype(np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q, query_start = ragged_queries(rng, q_lens, num_kv_heads * group, head_dim, pad_rows=3)
    mask = draft_tree_mask(rng, 6, max_q_len)[: len(q_lens)] if tree else None
    # Not causal (a branch is hidden from its sibling): a kernel that ignored the mask would fail.
    assert not tree or np.any(mask[0] != np.tril(np.ones_like(mask[0])))
    q, k, v = (jnp.asarray(x, BF16) for x in (q, k, v))
    args = (q, k, v, jnp.int32(LAYER), jnp.asarray(seq_lens), jnp.asarray(tables), jnp.asarray(query_start))
    interpreted = interpret_mode()  # compiled on the GPU (benchmarks/gpu_tests.py runs this file there)
    got = paged_extend_mgpu(
        *args,
        sm_scale=SM_SCALE,
        max_q_len=max_q_len,
        mask=mask,
        min_split_tokens=16,
        interpret=RACE_CHECKED if interpreted else None,
        **tuning,
    )
    want = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    assert not (interpreted and get_races().races_found)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    assert rel_err(got, np.asarray(want, np.float32)) < tolerance(BF16).rel
    assert not np.any(got[query_start[-1] :])  # padding rows are zeros


# (page_size, tree, window, softcap, sinks, tuning): causal prefill chunks whose rows' windows
# start inside the prefix, on and off tiles (masked head tiles, then unmasked, then masked), over
# two splits; verify trees under a window, a soft-cap and sinks; sinks alone over three splits.
FEATURE_CASES = [
    pytest.param(16, False, 45, None, False, dict(num_splits=2), id="s16-causal-window45-two_splits"),
    pytest.param(8, True, 30, 5.0, True, dict(num_splits=2, num_stages=3), id="s8-tree-window30-softcap-sinks"),
    pytest.param(16, False, None, None, True, dict(num_splits=3), id="s16-causal-sinks-three_splits"),
]


@pytest.mark.parametrize("page_size,tree,window,softcap,sinks,tuning", FEATURE_CASES)
def test_interpreted_windows_softcaps_and_sinks_match_reference(page_size, tree, window, softcap, sinks, tuning):
    rng = np.random.default_rng(page_size + (window or 0))
    num_kv_heads, group, head_dim = 2, 4, 64
    q_lens = np.array([6, 0, 3, 6]) if tree else np.array([20, 0, 5, 13])
    prefixes = np.array([200, 40, 77, 0]) if tree else np.array([150, 9, 30, 0])
    max_q_len = 8 if tree else int(q_lens.max())
    seq_lens = (prefixes + q_lens).astype(np.int32)
    k, v, tables = paged_problem(rng, seq_lens, page_size=page_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    q, query_start = ragged_queries(rng, q_lens, num_kv_heads * group, head_dim, pad_rows=3)
    mask = draft_tree_mask(rng, 6, max_q_len)[: len(q_lens)] if tree else None
    q, k, v = (jnp.asarray(x, BF16) for x in (q, k, v))
    args = (q, k, v, jnp.int32(LAYER), jnp.asarray(seq_lens), jnp.asarray(tables), jnp.asarray(query_start))
    features = dict(
        mask=mask,
        window=None if window is None else jnp.array([window], I32),
        logit_softcap=softcap,
        sinks=jnp.asarray(rng.standard_normal(num_kv_heads * group), jnp.float32) if sinks else None,
    )
    interpreted = interpret_mode()
    got = paged_extend_mgpu(
        *args,
        sm_scale=SM_SCALE,
        max_q_len=max_q_len,
        min_split_tokens=16,
        interpret=RACE_CHECKED if interpreted else None,
        **features,
        **tuning,
    )
    want = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, **features)
    assert not (interpreted and get_races().races_found)
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    assert rel_err(got, np.asarray(want, np.float32)) < tolerance(BF16).rel
    assert not np.any(got[query_start[-1] :])  # padding rows are zeros


# A tree of 8 tokens fills half a block's rows (only those travel); the others fill whole blocks.
@pytest.mark.parametrize("tree", [False, True])
def test_interpreted_fp8_kv_matches_reference(tree):
    """An FP8 pool (e4m3 bytes, as the engine stores it), its tiles upcast to f16 in shared
    memory: causal new tokens and a random tree, over two splits."""
    from kernels.test_fp8_kernels import fp8_paged_problem
    from kernels.test_kernels import random_tree_mask

    page_size, max_q_len = 16, 5
    q_lens = np.array([3, 0, 5, 1], np.int32)
    seq_lens = np.array([40, 0, 2 * page_size + 3, 1], np.int32)
    k8, v8, _, _, tables = fp8_paged_problem(page_size + tree, seq_lens, page_size)
    rng = np.random.default_rng(tree)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(query_start[-1]) + 2, 8, 64)), BF16)
    mask = jnp.asarray(random_tree_mask(rng, len(q_lens), max_q_len)) if tree else None
    args = (q, jnp.asarray(k8), jnp.asarray(v8), jnp.array([LAYER], I32), jnp.asarray(seq_lens))
    args += (jnp.asarray(tables), jnp.asarray(query_start))
    interpreted = interpret_mode()
    got = paged_extend_mgpu(
        *args,
        sm_scale=SM_SCALE,
        max_q_len=max_q_len,
        mask=mask,
        min_split_tokens=16,
        num_splits=2,
        interpret=RACE_CHECKED if interpreted else None,
    )
    want = paged_extend_ref(*args, sm_scale=SM_SCALE, max_q_len=max_q_len, mask=mask)
    assert not (interpreted and get_races().races_found)
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any() and not got[-2:].any()
    assert rel_err(got, np.asarray(want, np.float32)) < tolerance(BF16).rel


@pytest.mark.parametrize("group,tree,max_q_len", [(4, True, 8), (4, True, 40), (3, False, 40), (64, False, 40)])
def test_block_layout_round_trips(group, tree, max_q_len):
    """query_blocks then ragged_rows gives q back (zeros past the last sequence), the grid holds
    each (sequence, block) the queries need once and fewer items than batch x blocks where the
    rows allow, and each row's causal limit and mask bits say what the reference's masks say:
    the index arithmetic around the kernel, on the CPU without it."""
    rng = np.random.default_rng(group)
    num_kv_heads, head_dim = 2, 8
    q_lens = np.minimum([3, 0, 40, 17, 1, 1, 1, 1], max_q_len)
    prefixes = np.array([5, 9, 0, 100, 3, 60, 0, 7])
    q, query_start = ragged_queries(rng, q_lens, num_kv_heads * group, head_dim, pad_rows=4)
    mask = np.tril(rng.random((len(q_lens), max_q_len, max_q_len)) < 0.5) | np.eye(max_q_len, dtype=bool)
    kv_lens = jnp.asarray(prefixes + q_lens, I32)
    plan = mosaic_extend_plan(
        len(q_lens),
        num_kv_heads * group,
        (1, 9, 16, num_kv_heads, 64),
        20,
        max_q_len,
        q.shape[0],
        sm_scale=1.0,
        tree=tree,
    )
    blocks, row_limit, bits, _, (seq, block) = jax.jit(query_blocks, static_argnames=("plan", "num_kv_heads", "dtype"))(
        jnp.asarray(q),
        jnp.asarray(query_start),
        kv_lens,
        mask if tree else None,
        plan,
        num_kv_heads=num_kv_heads,
        dtype=jnp.float32,
    )
    need = [(b, j) for b, n in enumerate(q_lens) for j in reversed(range(-(-n // plan.tokens_per_block)))]
    assert len(need) <= plan.num_items <= len(q_lens) * plan.num_q_blocks
    seq, block = np.asarray(seq), np.asarray(block)
    assert list(zip(seq[: len(need)].tolist(), block[: len(need)].tolist())) == need
    assert (seq[len(need) :] == -1).all()
    assert blocks.shape == (plan.num_items * num_kv_heads, plan.block_rows, head_dim)
    back = jax.jit(ragged_rows, static_argnames=("plan", "num_rows", "num_q_heads", "num_kv_heads"))(
        blocks, jnp.asarray(query_start), plan, num_rows=q.shape[0], num_q_heads=q.shape[1], num_kv_heads=num_kv_heads
    )
    np.testing.assert_array_equal(back[: query_start[-1]], q[: query_start[-1]])
    assert not np.any(back[query_start[-1] :])
    # Each item row's token in its sequence, and whether it is one.
    rows = np.arange(GROUP_ROWS)
    token = block[:, None] * plan.tokens_per_block + rows // group  # [NI, R]
    owner = np.maximum(seq, 0)[:, None]
    real = (rows < plan.tokens_per_block * group) & (seq >= 0)[:, None] & (token < q_lens[owner])  # [NI, R]
    limit = prefixes[owner] - 1 if tree else prefixes[owner] + token
    want = np.where(real, limit, -1)
    np.testing.assert_array_equal(np.asarray(row_limit), want)
    if tree:
        words = np.asarray(bits).view(np.uint32)  # [NI, W, R]
        positions = np.arange(max_q_len)
        seen = (words[:, positions // 32, :] >> (positions % 32)[None, :, None]) & 1  # [NI, Q, R]
        rows_mask = mask[owner, np.minimum(token, max_q_len - 1)]  # [NI, R, Q]
        np.testing.assert_array_equal(seen.transpose(0, 2, 1), rows_mask & real[..., None])


def cache_specs(batch, ctx, page_size, num_kv_heads, head_dim, dtype=BF16):
    cache = jax.ShapeDtypeStruct((4, batch * ctx // page_size + 1, page_size, num_kv_heads, head_dim), dtype)
    lens, tables = jax.ShapeDtypeStruct((batch,), I32), jax.ShapeDtypeStruct((batch, ctx // page_size), I32)
    return cache, cache, jax.ShapeDtypeStruct((), I32), lens, tables, jax.ShapeDtypeStruct((batch + 1,), I32)


@pytest.mark.parametrize(
    "batch,ctx,q_len,page_size,num_q_heads,num_kv_heads,head_dim,tree,tuning",
    [
        # Llama-3.1-8B: tree verify of 32 x 8 tokens at ctx 4096 (split-K), a 2,048-token causal
        # prefill in 128-token tiles (one split: written directly).
        pytest.param(32, 4096, 8, 16, 32, 8, 128, True, {}, id="8b-verify_b32x8"),
        pytest.param(1, 2048, 2048, 16, 32, 8, 128, False, dict(block_n=128), id="8b-prefill_2048-n128"),
        # head_dim 256, tiles inside 256-token pages, a tree of 64 tokens (two mask words).
        pytest.param(8, 4096, 64, 256, 16, 2, 256, True, dict(num_stages=1), id="d256-tree64"),
        # The 8B tree verify over an FP8 pool.
        pytest.param(32, 4096, 8, 16, 32, 8, 128, True, dict(kv=jnp.uint8), id="8b-verify_b32x8-fp8"),
    ],
)
def test_kernel_lowers_for_cuda(batch, ctx, q_len, page_size, num_q_heads, num_kv_heads, head_dim, tree, tuning):
    tuning = dict(tuning)
    kv = tuning.pop("kv", BF16)
    q = jax.ShapeDtypeStruct((batch * q_len, num_q_heads, head_dim), BF16)
    specs = (q, *cache_specs(batch, ctx, page_size, num_kv_heads, head_dim, kv))
    call = functools.partial(paged_extend_mgpu, sm_scale=head_dim**-0.5, max_q_len=q_len, interpret=False, **tuning)
    if tree:
        fn = lambda *a: call(*a[:-1], mask=a[-1])  # noqa: E731
        specs += (jax.ShapeDtypeStruct((batch, q_len, q_len), jnp.bool_),)
    else:
        fn = call
    text = lower_for_cuda(fn, *specs).as_text()
    assert "custom_call @mosaic_gpu_v2" in text and "xla.gpu.triton" not in text


@pytest.mark.parametrize("tree", [False, True])
def test_kernel_with_window_softcap_and_sinks_lowers_for_cuda(tree):
    """gpt-oss-like attention (a window, sinks) with Gemma 2's soft-cap: a prefill chunk, a verify tree."""
    batch, q_len, num_q_heads, head_dim = 4, 8 if tree else 256, 32, 64
    q = jax.ShapeDtypeStruct((batch * q_len, num_q_heads, head_dim), BF16)
    window, sinks = jax.ShapeDtypeStruct((1,), I32), jax.ShapeDtypeStruct((num_q_heads,), jnp.float32)
    mask = jax.ShapeDtypeStruct((batch, q_len, q_len), jnp.bool_) if tree else None

    def fn(q, k, v, layer, lens, tables, starts, window, sinks, mask=None):
        return paged_extend_mgpu(
            q, k, v, layer, lens, tables, starts, sm_scale=0.125, max_q_len=q_len, mask=mask, window=window,
            logit_softcap=30.0, sinks=sinks, interpret=False,
        )  # fmt: skip

    specs = (q, *cache_specs(batch, 4096, 16, 8, head_dim), window, sinks) + ((mask,) if tree else ())
    text = lower_for_cuda(fn, *specs).as_text()
    assert "custom_call @mosaic_gpu_v2" in text and "xla.gpu.triton" not in text


@pytest.mark.parametrize(
    "change,feature",
    [
        (dict(dtype=jnp.float32), "float32 KV"),
        (dict(page_size=4), "page size 4"),
        (dict(head_dim=96), "head_dim 96"),
        (dict(max_q_len=2 * MAX_TREE_TOKENS, tree=True), f"tree mask over {2 * MAX_TREE_TOKENS} tokens"),
        (dict(num_warps=8), "num_warps 8"),
    ],
)
def test_refuses_by_name(change, feature):
    """What the kernel lacks raises MosaicUnsupported naming it, before any tracing of the kernel;
    mosaic_extend_unsupported() says the same without a call."""
    change = dict(change)
    page_size, head_dim, dtype = change.pop("page_size", 16), change.pop("head_dim", 64), change.pop("dtype", BF16)
    max_q_len, tree = change.pop("max_q_len", 4), change.pop("tree", False)
    q = jax.ShapeDtypeStruct((8, 8, head_dim), BF16)
    cache = jax.ShapeDtypeStruct((1, 9, page_size, 2, head_dim), dtype)
    extra = {}
    if tree:
        extra["mask"] = jax.ShapeDtypeStruct((2, max_q_len, max_q_len), jnp.bool_)
    call = functools.partial(paged_extend_mgpu, sm_scale=0.1, max_q_len=max_q_len, **change)
    specs = (q, cache, cache, jax.ShapeDtypeStruct((), I32), jax.ShapeDtypeStruct((2,), I32))
    tables, starts = jax.ShapeDtypeStruct((2, 4), I32), jax.ShapeDtypeStruct((3,), I32)
    with pytest.raises(MosaicUnsupported, match=feature) as refusal:
        jax.eval_shape(lambda *a, **kw: call(*a, **kw), *specs, tables, starts, **extra)
    assert "extend" in str(refusal.value)
    unsupported = mosaic_extend_unsupported(cache.shape, dtype, 8, max_q_len=max_q_len, tree=tree, **change)
    assert feature in unsupported
    assert (
        mosaic_extend_unsupported(cache.shape[:2] + (16, 2, 64), BF16, 8, max_q_len=MAX_TREE_TOKENS, tree=True) is None
    )


def test_tuning_out_of_range_is_a_value_error():
    q = jax.ShapeDtypeStruct((8, 8, 64), BF16)
    cache = jax.ShapeDtypeStruct((1, 9, 16, 2, 64), BF16)
    specs = (q, cache, cache, jax.ShapeDtypeStruct((), I32), jax.ShapeDtypeStruct((2,), I32))
    specs += (jax.ShapeDtypeStruct((2, 4), I32), jax.ShapeDtypeStruct((3,), I32))
    for tuning, message in ((dict(block_m=32), "block_m"), (dict(block_n=32), "block_n")):
        call = functools.partial(paged_extend_mgpu, sm_scale=0.1, max_q_len=4, **tuning)
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(call, *specs)
    with pytest.raises(ValueError, match="shared memory"):
        mosaic_extend_plan(1, 8, (1, 9, 16, 2, 256), 4, 4, sm_scale=0.1, block_n=256, num_stages=2)

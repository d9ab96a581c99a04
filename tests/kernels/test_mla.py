"""Multi-head latent attention: the jnp references (absorbed and expanded forms) against a
float64 brute force that expands every cached latent, and the Pallas absorbed decode kernel
(interpreted) against its reference; poisoned caches as in test_kernels."""

import jax.numpy as jnp
import numpy as np
import pytest
from support.precision import tolerance
from test_kernels import FAR_PAGE, LAYER, LAYERS, random_tree_mask, rel_err

from jspec.kernels.mla_decode import mla_decode
from jspec.kernels.mla_ref import mla_decode_ref, mla_extend_expanded_ref, mla_extend_ref

R, P, NOPE, V, HEADS = 32, 8, 16, 12, 4
SCALE = 0.3


def latent_problem(rng, seq_lens, page_size, width=R + P):
    """A NaN-poisoned latent cache [LAYERS, pages, S, 1, width] holding each sequence's rows on
    shuffled pages of layer LAYER (odd rows' tables point past their pages at FAR_PAGE)."""
    pages_needed = [-(-int(n) // page_size) for n in seq_lens]
    num_pages = sum(pages_needed) + 2
    cache = np.full((LAYERS, num_pages, page_size, 1, width), np.nan, np.float32)
    tables = np.full((len(seq_lens), max(pages_needed) + 1), num_pages - 1, np.int32)
    owned, cursor = rng.permutation(sum(pages_needed)), 0
    for b, (n, k) in enumerate(zip(seq_lens, pages_needed)):
        tables[b, :k] = owned[cursor : cursor + k]
        cursor += k
        if b % 2:
            tables[b, k:] = FAR_PAGE
        for t in range(n):
            cache[LAYER, tables[b, t // page_size], t % page_size, 0] = rng.standard_normal(width)
    return cache, tables


def brute_force(q_nope, q_rope, cache, tables, seq_lens, w_uk, w_uv, owners, visible_fn, page_size):
    """Per row and head: keys [W_UK c | k_rope], values W_UV c, softmax in float64 -> [T, H, V]."""
    out = np.zeros((len(owners), HEADS, V))
    for row, owner in enumerate(owners):
        if owner is None:
            continue
        b, i = owner
        js = [j for j in range(seq_lens[b]) if visible_fn(b, i, j)]
        lat = np.stack([cache[LAYER, tables[b, j // page_size], j % page_size, 0] for j in js]).astype(np.float64)
        c, kr = lat[:, :R], lat[:, R:]
        for h in range(HEADS):
            keys = np.concatenate([c @ w_uk[h].T, kr], axis=1)
            s = keys @ np.concatenate([q_nope[row, h], q_rope[row, h]]) * SCALE
            w = np.exp(s - s.max())
            out[row, h] = (w / w.sum()) @ (c @ w_uv[h].T)
    return out


def problem(seed, page_size, q_lens, seq_lens):
    rng = np.random.default_rng(seed)
    cache, tables = latent_problem(rng, seq_lens, page_size)
    w_uk = rng.standard_normal((HEADS, NOPE, R)).astype(np.float32) / np.sqrt(R)
    w_uv = rng.standard_normal((HEADS, V, R)).astype(np.float32) / np.sqrt(R)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(starts[-1]) + 3
    q_nope = rng.standard_normal((T, HEADS, NOPE)).astype(np.float32)
    q_rope = rng.standard_normal((T, HEADS, P)).astype(np.float32)
    owners = [None] * T
    for b, n in enumerate(q_lens):
        for i in range(n):
            owners[starts[b] + i] = (b, i)
    return cache, tables, w_uk, w_uv, starts, q_nope, q_rope, owners


def absorbed(q_nope, q_rope, w_uk):
    return np.concatenate([np.einsum("thn,hnr->thr", q_nope, w_uk), q_rope], axis=-1).astype(np.float32)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("tree", [False, True])
def test_mla_references_match_brute_force(page_size, tree):
    q_lens, seq_lens = [5, 3, 1], np.array([9, 3, 14], np.int32)
    cache, tables, w_uk, w_uv, starts, q_nope, q_rope, owners = problem(7, page_size, q_lens, seq_lens)
    rng = np.random.default_rng(1)
    mask = random_tree_mask(rng, len(q_lens), 8) if tree else None
    prefix = [int(n - q) for n, q in zip(seq_lens, q_lens)]

    def visible(b, i, j):
        if j < prefix[b]:
            return True
        return bool(mask[b, i, j - prefix[b]]) if tree else j <= prefix[b] + i

    want = brute_force(q_nope, q_rope, cache, tables, seq_lens, w_uk, w_uv, owners, visible, page_size)
    real = [r for r, o in enumerate(owners) if o is not None]
    args = (jnp.int32(LAYER), seq_lens, tables, starts)
    lat = mla_extend_ref(
        absorbed(q_nope, q_rope, w_uk), cache, *args, kv_lora_rank=R, sm_scale=SCALE, max_q_len=8, mask=mask
    )
    got = np.einsum("thr,hvr->thv", np.asarray(lat), w_uv)
    tol = tolerance(dots="exact")
    assert rel_err(got[real], want[real]) < tol.rel
    if not tree:
        expanded = mla_extend_expanded_ref(q_nope, q_rope, cache, w_uk, w_uv, *args, sm_scale=SCALE, max_q_len=8)
        assert rel_err(np.asarray(expanded)[real], want[real]) < tol.rel


@pytest.mark.parametrize(
    "page_size,tuning", [(1, dict(block_n=16, num_splits=1)), (4, dict(block_n=16, num_splits=3)), (16, dict())]
)
def test_mla_decode_kernel_matches_reference(page_size, tuning):
    seq_lens = np.array([0, 1, 2 * page_size + 3, 41], np.int32)
    cache, tables, w_uk, _, _, q_nope, q_rope, _ = problem(3, page_size, [1] * 4, np.maximum(seq_lens, 1))
    q = absorbed(q_nope[:4], q_rope[:4], w_uk)
    args = (q, cache, jnp.int32(LAYER), seq_lens, tables)
    ref = mla_decode_ref(*args, kv_lora_rank=R, sm_scale=SCALE)
    out = mla_decode(*args, kv_lora_rank=R, sm_scale=SCALE, min_split_tokens=16, **tuning)
    assert out.shape == (4, HEADS, R) and not np.isnan(np.asarray(out)).any()
    tol = tolerance()
    assert rel_err(out[1:], ref[1:]) < tol.rel
    assert not np.any(np.asarray(out[0]))  # nothing cached -> zeros
    out_lse, lse = mla_decode(*args, kv_lora_rank=R, sm_scale=SCALE, return_lse=True, **tuning)
    assert rel_err(out_lse[1:], ref[1:]) < tol.rel and np.isneginf(np.asarray(lse[0])).all()


def test_mla_decode_head_blocks_cover_every_head():
    """More heads than one program holds, and not a multiple of it: the default block (32) runs
    two head blocks, the last one part empty; 16 per block gives the same numbers."""
    heads, page_size = 40, 4
    seq_lens = np.array([5, 17, 30], np.int32)
    rng = np.random.default_rng(7)
    cache, tables = latent_problem(rng, seq_lens, page_size)
    q = rng.standard_normal((3, heads, R + P)).astype(np.float32)
    args = (q, cache, jnp.int32(LAYER), seq_lens, tables)
    ref = mla_decode_ref(*args, kv_lora_rank=R, sm_scale=SCALE)
    tol = tolerance()
    for block_h in (32, 16):
        out = mla_decode(*args, kv_lora_rank=R, sm_scale=SCALE, block_h=block_h, num_splits=1)
        assert out.shape == (3, heads, R)
        assert rel_err(out, ref) < tol.rel, block_h


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("batch,page_size,heads", [(32, 64, 128), (1, 1, 16)])
def test_mla_decode_lowers_for_h200(batch, page_size, heads):
    """DeepSeek-V3's shapes (rank 512, RoPE 64, bf16) lowered for an abstract H200 (interpret
    mode hides Triton lowering errors): 128 heads as on one GPU, 16 as a TP-8 shard."""
    import functools

    import jax
    from support.lowering import lower_for_cuda

    ctx = 4096
    cache = jax.ShapeDtypeStruct((2, batch * ctx // page_size + 1, page_size, 1, 576), jnp.bfloat16)
    specs = (
        jax.ShapeDtypeStruct((batch, heads, 576), jnp.bfloat16),
        cache,
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
        jax.ShapeDtypeStruct((batch, ctx // page_size), jnp.int32),
    )
    fn = functools.partial(mla_decode, kv_lora_rank=512, sm_scale=0.1, interpret=False)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *specs).as_text()


@pytest.mark.parametrize("page_size,tree", [(1, True), (4, False), (4, True)])
def test_mla_extend_kernel_matches_reference(page_size, tree):
    from jspec.kernels.mla_decode import mla_extend

    q_lens, seq_lens = [5, 3, 1, 0], np.array([9, 3, 14, 0], np.int32)
    cache, tables, w_uk, _, starts, q_nope, q_rope, owners = problem(11, page_size, q_lens, np.maximum(seq_lens, 1))
    mask = random_tree_mask(np.random.default_rng(2), len(q_lens), 8) if tree else None
    q = absorbed(q_nope, q_rope, w_uk)
    args = (q, cache, jnp.int32(LAYER), seq_lens, tables, starts)
    kw = dict(kv_lora_rank=R, sm_scale=SCALE, max_q_len=8, mask=mask)
    ref = mla_extend_ref(*args, **kw)
    out = mla_extend(*args, block_n=16, **kw)
    real = [r for r, o in enumerate(owners) if o is not None]
    assert rel_err(np.asarray(out)[real], np.asarray(ref)[real]) < tolerance().rel
    assert not np.asarray(out)[len(real) :].any()  # padding rows: zeros


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("tree", [False, True])
def test_mla_extend_lowers_for_h200(tree):
    import functools

    import jax
    from support.lowering import lower_for_cuda

    from jspec.kernels.mla_decode import mla_extend

    batch, q_len, ctx, page_size, heads = 16, 8, 4096, 64, 128
    I32 = jnp.int32
    specs = (
        jax.ShapeDtypeStruct((batch * q_len, heads, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((2, batch * ctx // page_size + 1, page_size, 1, 576), jnp.bfloat16),
        jax.ShapeDtypeStruct((), I32),
        jax.ShapeDtypeStruct((batch,), I32),
        jax.ShapeDtypeStruct((batch, ctx // page_size), I32),
        jax.ShapeDtypeStruct((batch + 1,), I32),
    )
    kw = dict(kv_lora_rank=512, sm_scale=0.1, max_q_len=q_len, interpret=False)
    if tree:
        specs += (jax.ShapeDtypeStruct((batch, q_len, q_len), jnp.bool_),)

        def fn(*a):
            return mla_extend(*a[:6], mask=a[6], **kw)
    else:
        fn = functools.partial(mla_extend, **kw)
    assert "__gpu$xla.gpu.triton" in lower_for_cuda(fn, *specs).as_text()

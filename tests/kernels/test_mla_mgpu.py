"""The Mosaic GPU MLA decode and extend kernels: run by Mosaic GPU's interpreter on the CPU (race detector
on, fresh shared memory NaN, the poisoned latent caches of test_mla.py) against the absorbed
references, lowered for CUDA at DeepSeek-V3's and V2-Lite's shapes, and refusing by name what they
do not cover. Compiled on the GPU by benchmarks/gpu_tests.py, as every file here."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The race detector's verdict has no public name in jax 0.11.2.
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
from jax.experimental.pallas import mosaic_gpu as plgpu
from kernels.test_kernels import LAYER, random_tree_mask, rel_err
from kernels.test_mla import latent_problem
from support.lowering import lower_for_cuda
from support.precision import tolerance

from jspec.kernels.backend import interpret_mode
from jspec.kernels.mgpu_tiles import GROUP_ROWS, MosaicUnsupported
from jspec.kernels.mla_decode_mgpu import mla_decode_mgpu, mla_extend_mgpu, mla_mosaic_unsupported
from jspec.kernels.mla_ref import mla_decode_ref, mla_extend_ref
from jspec.kernels.ref import paged_decode_ref

BF16, I32 = jnp.bfloat16, jnp.int32
RACE_CHECKED = plgpu.InterpretGPUParams(detect_races=True)
SCALE = 0.1


def latent_cache(rng, seq_lens, page_size, width):
    """test_mla's poisoned latent problem, in bf16 (the Mosaic kernels' 16-bit cache)."""
    cache, tables = latent_problem(rng, seq_lens, page_size, width)
    return jnp.asarray(cache, BF16), tables


# (rank, rope, heads, page size, tuning): one value chunk and a head block padded from 16;
# DeepSeek-V3's latent (two value chunks, 224 KiB of shared memory) over two head blocks with
# split-K and the log-sum-exp; a 128-token page holding two tiles of 64, three splits.
CASES = [
    pytest.param(128, 64, 16, 16, dict(num_splits=1), id="r128-h16-s16-one_split"),
    pytest.param(512, 64, 128, 16, dict(num_splits=2, return_lse=True), id="r512-h128-s16-two_chunks-lse"),
    pytest.param(256, 64, 20, 128, dict(num_splits=3, num_stages=1), id="r256-h20-s128-tile_in_page"),
]


@pytest.mark.parametrize("rank,rope,heads,page_size,tuning", CASES)
def test_interpreted_kernel_matches_reference(rank, rope, heads, page_size, tuning):
    rng = np.random.default_rng(rank + heads)
    # Empty, one token, just past two pages, and several tiles.
    seq_lens = np.array([0, 1, 2 * page_size + 3, 200], np.int32)
    cache, tables = latent_cache(rng, seq_lens, page_size, rank + rope)
    q = jnp.asarray(rng.standard_normal((len(seq_lens), heads, rank + rope)), BF16)
    args = (q, cache, jnp.array([LAYER], I32), jnp.asarray(seq_lens), jnp.asarray(tables))
    tuning = dict(tuning)
    return_lse = tuning.pop("return_lse", False)
    interpreted = interpret_mode()
    got = mla_decode_mgpu(
        *args,
        kv_lora_rank=rank,
        sm_scale=SCALE,
        min_split_tokens=16,
        return_lse=return_lse,
        interpret=RACE_CHECKED if interpreted else None,
        **tuning,
    )
    want = mla_decode_ref(*args, kv_lora_rank=rank, sm_scale=SCALE)
    assert not (interpreted and get_races().races_found)
    tol = tolerance(BF16)
    if return_lse:
        got, lse = got
        # The log-sum-exp of the scores over the whole latent, as paged attention's.
        _, want_lse = paged_decode_ref(q, cache, cache, *args[2:], sm_scale=SCALE, return_lse=True)
        np.testing.assert_allclose(lse, want_lse, rtol=tol.rtol, atol=tol.lse_atol)
        assert np.isneginf(np.asarray(lse[0])).all()
    else:
        assert got.shape == (len(seq_lens), heads, rank) and got.dtype == q.dtype
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any()
    assert rel_err(got, np.asarray(want, np.float32)) < tol.rel
    assert not np.any(got[0])  # an empty sequence attends to nothing


# (rank, heads, page size, tree): causal new tokens, one value chunk, 16 heads padded to a block;
# DeepSeek-V3's latent and 128 heads under a verify tree (two blocks, two chunks, the mask's bits);
# a tree over pages of a whole tile, 20 heads.
EXTEND_CASES = [
    pytest.param(128, 16, 16, False, id="r128-h16-s16-causal"),
    pytest.param(512, 128, 16, True, id="r512-h128-s16-tree"),
    pytest.param(256, 20, 64, True, id="r256-h20-s64-tree"),
]


@pytest.mark.parametrize("rank,heads,page_size,tree", EXTEND_CASES)
def test_interpreted_extend_matches_reference(rank, heads, page_size, tree):
    """New tokens after a prefix (several, none, a prefix of two pages and a bit, a first token),
    rows past the last sequence's (zeros), causal or a random tree among them."""
    rng = np.random.default_rng(rank + heads + tree)
    q_lens = np.array([3, 0, 4, 1], np.int32)
    seq_lens = np.array([40, 0, 2 * page_size + 3, 1], np.int32)
    max_q_len = 4
    cache, tables = latent_cache(rng, seq_lens, page_size, rank + 64)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((int(query_start[-1]) + 2, heads, rank + 64)), BF16)
    mask = jnp.asarray(random_tree_mask(rng, len(q_lens), max_q_len)) if tree else None
    args = (q, cache, jnp.array([LAYER], I32), jnp.asarray(seq_lens), jnp.asarray(tables), jnp.asarray(query_start))
    kw = dict(kv_lora_rank=rank, sm_scale=SCALE, max_q_len=max_q_len, mask=mask)
    interpreted = interpret_mode()
    got = mla_extend_mgpu(*args, interpret=RACE_CHECKED if interpreted else None, **kw)
    want = mla_extend_ref(*args, **kw)
    assert not (interpreted and get_races().races_found)
    assert got.shape == (q.shape[0], heads, rank) and got.dtype == q.dtype
    got = np.asarray(got, np.float32)
    assert not np.isnan(got).any() and not got[-2:].any()
    assert rel_err(got, np.asarray(want, np.float32)) < tolerance(BF16).rel


def test_extend_lowers_for_cuda():
    """A verify tree of 8 tokens over DeepSeek-V3's latent and 128 heads."""
    B, Q, ctx, width = 8, 8, 4096, 576
    specs = (
        jax.ShapeDtypeStruct((B * Q, 128, width), BF16),
        jax.ShapeDtypeStruct((2, B * ctx // 16 + 1, 16, 1, width), BF16),
        jax.ShapeDtypeStruct((), I32),
        jax.ShapeDtypeStruct((B,), I32),
        jax.ShapeDtypeStruct((B, ctx // 16), I32),
        jax.ShapeDtypeStruct((B + 1,), I32),
    )
    mask = jax.ShapeDtypeStruct((B, Q, Q), jnp.bool_)
    fn = functools.partial(mla_extend_mgpu, kv_lora_rank=512, sm_scale=0.1, max_q_len=Q, interpret=False)
    text = lower_for_cuda(lambda *a: fn(*a[:-1], mask=a[-1]), *specs, mask).as_text()
    assert "custom_call @mosaic_gpu_v2" in text and "xla.gpu.triton" not in text


@pytest.mark.parametrize(
    "batch,ctx,page_size,heads,rank,tuning",
    [
        (32, 4096, 64, 128, 512, {}),  # DeepSeek-V3: two head blocks, two value chunks, split-K
        (128, 2048, 64, 16, 512, dict(num_splits=1)),  # V2-Lite's 16 heads, one split
        (8, 4096, 16, 128, 512, dict(return_lse=True)),
    ],
)
def test_kernel_lowers_for_cuda(batch, ctx, page_size, heads, rank, tuning):
    width = rank + 64
    q = jax.ShapeDtypeStruct((batch, heads, width), BF16)
    cache = jax.ShapeDtypeStruct((2, batch * ctx // page_size + 1, page_size, 1, width), BF16)
    specs = (
        q,
        cache,
        jax.ShapeDtypeStruct((), I32),
        jax.ShapeDtypeStruct((batch,), I32),
        jax.ShapeDtypeStruct((batch, ctx // page_size), I32),
    )
    fn = functools.partial(mla_decode_mgpu, kv_lora_rank=rank, sm_scale=width**-0.5, interpret=False, **tuning)
    text = lower_for_cuda(fn, *specs).as_text()
    assert "custom_call @mosaic_gpu_v2" in text and "xla.gpu.triton" not in text


@pytest.mark.parametrize(
    "change,feature",
    [
        (dict(dtype=jnp.uint8), "FP8 latent cache"),
        (dict(dtype=jnp.float32), "float32 latent cache"),
        (dict(page_size=4), "page size 4"),
        (dict(rank=96), "rank 96"),
        (dict(rank=320, rope=64), "rank 320"),
    ],
)
def test_refuses_by_name(change, feature):
    """What the kernel lacks raises MosaicUnsupported naming it before the kernel is traced, and
    mla_mosaic_unsupported() says the same without a call."""
    page_size, rank, rope = change.get("page_size", 16), change.get("rank", 128), change.get("rope", 64)
    dtype = change.get("dtype", BF16)
    cache = jax.ShapeDtypeStruct((1, 9, page_size, 1, rank + rope), dtype)
    specs = (
        jax.ShapeDtypeStruct((2, 8, rank + rope), BF16),
        cache,
        jax.ShapeDtypeStruct((), I32),
        jax.ShapeDtypeStruct((2,), I32),
        jax.ShapeDtypeStruct((2, 4), I32),
    )
    call = functools.partial(mla_decode_mgpu, kv_lora_rank=rank, sm_scale=0.1)
    with pytest.raises(MosaicUnsupported, match=feature):
        jax.eval_shape(call, *specs)
    assert feature in mla_mosaic_unsupported(cache.shape, dtype, rank)
    assert mla_mosaic_unsupported((1, 9, 64, 1, 576), BF16, 512) is None


def test_shared_memory_bounds_the_tile():
    """At DeepSeek-V3's width two stages of 64 rows fit Hopper's shared memory; a third, or
    tiles of 128, do not, and the plan says so by name."""
    width = 576
    specs = (
        jax.ShapeDtypeStruct((1, 128, width), BF16),
        jax.ShapeDtypeStruct((1, 9, 64, 1, width), BF16),
        jax.ShapeDtypeStruct((), I32),
        jax.ShapeDtypeStruct((1,), I32),
        jax.ShapeDtypeStruct((1, 8), I32),
    )
    for tuning in (dict(num_stages=3), dict(block_n=128)):
        call = functools.partial(mla_decode_mgpu, kv_lora_rank=512, sm_scale=0.1, **tuning)
        with pytest.raises(ValueError, match="shared memory"):
            jax.eval_shape(call, *specs)


def deepseek(**hf):
    """A small DeepSeek-V3 config (shapes only): MLA with a 64-wide rank and RoPE key, and as many
    query heads as a Mosaic program multiplies (fewer run the Triton-backend kernels)."""
    from jspec.config.deepseek import deepseek_fields
    from jspec.config.model import ModelConfig

    base = dict(
        num_hidden_layers=2,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=GROUP_ROWS,
        vocab_size=1024,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        max_position_embeddings=4096,
    )
    return ModelConfig(**deepseek_fields("DeepseekV3ForCausalLM", {**base, **hf}))


@pytest.mark.parametrize(
    "hf,settings,feature",
    [
        ({}, dict(kv_cache_dtype="fp8_e4m3"), "FP8 latent cache"),
        ({}, dict(page_size=4), "page size 4"),
        (dict(kv_lora_rank=96), {}, "rank 96"),
    ],
)
def test_engine_build_takes_latent_attention_and_refuses_what_the_kernel_lacks(hf, settings, feature):
    """--attention-backend mosaic on a DeepSeek model: its decode on the Mosaic kernel (a bf16
    latent cache, pages of 16), and what the kernel lacks refused by name at build."""
    from jspec.config.engine import EngineConfig
    from jspec.engine.build import check_attention_backend

    check_attention_backend(EngineConfig(attention_backend="mosaic"), deepseek(), BF16)
    with pytest.raises(MosaicUnsupported, match=feature):
        check_attention_backend(EngineConfig(attention_backend="mosaic", **settings), deepseek(**hf), BF16)
    # A model of fewer heads runs the Triton-backend kernels: the Mosaic kernel's limits are not
    # checked (an FP8 latent cache is refused on every backend, when the pool is sized).
    few = deepseek(**hf, num_attention_heads=16)
    check_attention_backend(EngineConfig(attention_backend="mosaic", **settings), few, BF16)


@pytest.mark.parametrize("step,heads", [("decode", GROUP_ROWS), ("verify", GROUP_ROWS), ("decode", 16)])
def test_deepseek_forward_with_the_mosaic_backend_lowers_for_cuda(step, heads, monkeypatch):
    """--attention-backend mosaic on a DeepSeek model: a decode step and a verify (a tree mask)
    call the Mosaic GPU MLA kernels and add-and-norm and no Triton kernel; with fewer heads than
    a Mosaic program multiplies, the Triton-backend MLA kernels, which the GPU measured faster
    there."""
    import jspec.kernels.backend
    import jspec.layers.norm
    from jspec.checkpoint.loader import param_shapes
    from jspec.kvcache.pool import KVPool
    from jspec.layers.batch import AttentionMode, ForwardBatch
    from jspec.models.forward import forward

    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)  # kernels as on the GPU
    monkeypatch.setattr(jspec.layers.norm, "one_gpu", lambda: True)  # the add-and-norm kernel, as on one GPU
    monkeypatch.delenv("JSPEC_ADD_RMS_NORM", raising=False)
    cfg = deepseek(num_attention_heads=heads)
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, BF16), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )
    decode_only = step == "decode"
    B, Q, S, pages = 8, 1 if decode_only else 4, 16, 16
    T = B * Q
    latent = jax.ShapeDtypeStruct((cfg.num_layers, B * pages + 1, S, 1, cfg.deepseek.latent_dim), BF16)
    empty = jax.ShapeDtypeStruct((cfg.num_layers, B * pages + 1, S, 1, 0), BF16)
    batch = ForwardBatch(
        *(jax.ShapeDtypeStruct((n,), I32) for n in (T, T, T, B)),
        jax.ShapeDtypeStruct((B, pages), I32),
        jax.ShapeDtypeStruct((B + 1,), I32),
        jax.ShapeDtypeStruct((B,), I32),
    )
    mode = AttentionMode(decode_only, Q, "mosaic")
    mask = None if decode_only else jax.ShapeDtypeStruct((B, Q, Q), jnp.bool_)
    fn = lambda p, kv, b, m: forward(p, cfg, kv, b, mode, mask=m)[1].logits  # noqa: E731
    text = lower_for_cuda(fn, params, KVPool(latent, empty), batch, mask).as_text()
    on_mosaic = heads >= GROUP_ROWS
    assert "add_rms_norm_mgpu" in text  # the add-and-norm follows the attention backend either way
    assert ("xla.gpu.triton" in text) != on_mosaic

"""Jit-compile tests: lower each kernel for CUDA on this CPU-only machine.

Interpret mode hides Triton lowering errors (a tile whose size is not a power of
two runs interpreted and fails on the GPU). Here each kernel is traced and
lowered for an abstract H200 with interpret=False, at realistic bf16 shapes.

What level this reaches: Pallas builds the Triton IR (TTIR, the `tt` MLIR
dialect) in Python and MLIR verifies each op as it is built, so unsupported
primitives, mixed index forms, non-power-of-2 arrays and dtype mismatches in
tl.dot fail here. What it cannot reach: the TTIR -> TTGIR -> LLVM -> PTX
compilation runs inside XLA's GPU compiler (the CUDA plugin), so shared-memory
overflow, register pressure and Triton pass failures still show up only on a
GPU (benchmarks/bench_kernels.py compiles every variant there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from support.lowering import lower_for_cuda, triton_dots

from jspec.kernels.mla_decode import mla_decode
from jspec.kernels.paged_decode import paged_decode
from jspec.kernels.paged_extend import paged_extend
from jspec.kernels.skinny_matmul import skinny_matmul

BF16, I32 = jnp.bfloat16, jnp.int32
LAYERS = 4

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def cache_specs(batch, ctx, page_size, num_kv_heads, head_dim, layers=LAYERS, table_ctx=None):
    """A pool for batch sequences of ctx tokens; the page table addresses table_ctx tokens (default ctx)."""
    num_pages = batch * ctx // page_size + 1
    cache = jax.ShapeDtypeStruct((layers, num_pages, page_size, num_kv_heads, head_dim), BF16)
    return (
        cache,
        cache,
        jax.ShapeDtypeStruct((), I32),
        jax.ShapeDtypeStruct((batch,), I32),
        jax.ShapeDtypeStruct((batch, (table_ctx or ctx) // page_size), I32),
    )


def assert_has_triton_call(lowered):
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_lowering_catches_a_non_power_of_two_array():
    """The harness itself: a 48-element array fails to lower; the same kernel at 64 lowers."""

    def kernel_with(n):
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] + jnp.sum(jax.lax.iota(jnp.float32, n))

        return kernel

    def call(n, x):
        return pl.pallas_call(kernel_with(n), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=False)(x)

    spec = jax.ShapeDtypeStruct((64,), jnp.float32)
    assert_has_triton_call(lower_for_cuda(functools.partial(call, 64), spec))
    with pytest.raises(Exception, match="power-of-two|power of 2"):
        lower_for_cuda(functools.partial(call, 48), spec)


@pytest.mark.parametrize(
    "batch,ctx,page_size,num_q_heads,num_kv_heads,head_dim,tuning",
    [
        (32, 4096, 16, 32, 8, 128, {}),
        (32, 4096, 1, 32, 8, 128, {}),
        (32, 4096, 64, 32, 8, 128, {}),
        (1, 4096, 16, 32, 8, 128, {}),  # split-K path
        (8, 1024, 16, 32, 8, 128, dict(block_n=128, num_warps=8, num_stages=3)),
        (32, 4096, 16, 32, 8, 128, dict(block_n=32, num_splits=1, num_stages=4)),
        (4, 2048, 16, 32, 32, 64, {}),  # MHA, head_dim 64
        (4, 2048, 64, 64, 8, 128, dict(block_n=32)),  # group of 8
        (32, 4096, 16, 32, 8, 128, dict(layers=32)),  # 8.6 GB cache: 64-bit offsets
        # Tables as wide as the longest context (512 x 16 = 8192 tokens) over a smaller pool.
        (1, 1024, 16, 32, 8, 128, dict(table_ctx=8192)),  # many splits
        (32, 1024, 16, 32, 8, 128, dict(table_ctx=8192)),
        (4, 512, 1, 9, 3, 64, dict(table_ctx=8192)),  # SmolLM2-135M heads, 8192-column table
        (32, 4096, 16, 32, 8, 128, dict(window=True)),  # sliding window, a traced int32
        (1, 4096, 16, 32, 8, 128, dict(window=True, return_lse=True)),  # split-K path
        (8, 4096, 16, 8, 4, 256, dict(window=True, logit_softcap=50.0)),  # Gemma 2: head_dim 256, capped
        (8, 4096, 16, 64, 8, 64, dict(window=True, sinks=True)),  # gpt-oss: sinks, split-K
        (64, 4096, 16, 64, 8, 64, dict(window=True, sinks=True, num_splits=1)),  # sinks, one split
    ],
)
def test_paged_decode_lowers_for_cuda(batch, ctx, page_size, num_q_heads, num_kv_heads, head_dim, tuning):
    q = jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), BF16)
    tuning = dict(tuning)
    if tuning.pop("window", False):
        fn = functools.partial(paged_decode, sm_scale=head_dim**-0.5, interpret=False, **tuning)
        specs = (q, *cache_specs(batch, ctx, page_size, num_kv_heads, head_dim), jax.ShapeDtypeStruct((), I32))
        if fn.keywords.pop("sinks", False):
            specs = (*specs, jax.ShapeDtypeStruct((num_q_heads,), jnp.float32))
            lowered = lower_for_cuda(lambda *a: fn(*a[:6], window=a[6], sinks=a[7]), *specs)
        else:
            lowered = lower_for_cuda(lambda *a: fn(*a[:6], window=a[6]), *specs)
        assert_has_triton_call(lowered)
        return
    specs = (
        q,
        *cache_specs(
            batch, ctx, page_size, num_kv_heads, head_dim, tuning.pop("layers", LAYERS), tuning.pop("table_ctx", None)
        ),
    )
    fn = functools.partial(paged_decode, sm_scale=head_dim**-0.5, interpret=False, **tuning)
    assert_has_triton_call(lower_for_cuda(fn, *specs))


@pytest.mark.parametrize(
    "batch,q_len,ctx,page_size,num_kv_heads,head_dim,tree,tuning",
    [
        (32, 8, 4096, 16, 8, 128, True, {}),  # tree verification
        (1, 16, 512, 16, 8, 128, True, {}),  # a short verify at B=1: 16-row blocks, one-tile splits
        (32, 8, 4096, 1, 8, 128, True, dict(num_splits=1)),
        (32, 8, 4096, 64, 8, 128, False, {}),
        (1, 2048, 2048, 16, 8, 128, False, {}),  # long prefill
        (1, 2048, 2048, 64, 8, 128, False, dict(block_m=64, block_n=64, num_warps=4, num_stages=3)),
        (4, 64, 1024, 16, 32, 64, True, dict(block_m=64)),  # MHA, head_dim 64, 64-token tree
        (32, 8, 4096, 16, 8, 128, True, dict(layers=32)),  # 8.6 GB cache: 64-bit offsets
        # Tables as wide as the longest context over a smaller pool.
        (32, 8, 1024, 16, 8, 128, True, dict(table_ctx=8192)),
        (1, 512, 1024, 16, 8, 128, False, dict(table_ctx=8192)),  # a prefill chunk
        (4, 64, 512, 64, 32, 64, True, dict(table_ctx=8192, num_splits=4)),
        (32, 8, 4096, 16, 8, 128, True, dict(window=True)),  # sliding window under a tree
        (1, 2048, 2048, 16, 8, 128, False, dict(window=True)),  # windowed long prefill
        (4, 512, 4096, 16, 8, 128, False, dict(window=True, num_splits=4)),
        (8, 8, 4096, 16, 4, 256, True, dict(window=True, logit_softcap=50.0)),  # Gemma 2 under a tree
        (8, 8, 4096, 16, 8, 64, True, dict(window=True, sinks=True)),  # gpt-oss under a tree
        (1, 2048, 2048, 16, 8, 64, False, dict(window=True, sinks=True)),  # gpt-oss prefill
    ],
)
def test_paged_extend_lowers_for_cuda(batch, q_len, ctx, page_size, num_kv_heads, head_dim, tree, tuning):
    num_q_heads = 32
    q = jax.ShapeDtypeStruct((batch * q_len, num_q_heads, head_dim), BF16)
    query_start = jax.ShapeDtypeStruct((batch + 1,), I32)
    tuning = dict(tuning)
    layers = tuning.pop("layers", LAYERS)
    specs = [
        q,
        *cache_specs(batch, ctx, page_size, num_kv_heads, head_dim, layers, tuning.pop("table_ctx", None)),
        query_start,
    ]
    windowed = tuning.pop("window", False)
    if tree:
        specs.append(jax.ShapeDtypeStruct((batch, q_len, q_len), jnp.bool_))
    if windowed:
        specs.append(jax.ShapeDtypeStruct((), I32))
    sinked = tuning.pop("sinks", False)
    if sinked:
        specs.append(jax.ShapeDtypeStruct((num_q_heads,), jnp.float32))

    def fn(*args):
        mask = args[7] if tree else None
        window = args[8 if tree else 7] if windowed else None
        sinks = args[-1] if sinked else None
        return paged_extend(
            *args[:7],
            sm_scale=head_dim**-0.5,
            max_q_len=q_len,
            mask=mask,
            window=window,
            sinks=sinks,
            interpret=False,
            **tuning,
        )

    assert_has_triton_call(lower_for_cuda(fn, *specs))


@pytest.mark.parametrize(
    "K,N,tuning",
    [
        (4096, 6144, {}),  # Llama-3.1-8B qkv
        (4096, 4096, {}),  # o
        (4096, 28672, {}),  # gate_up
        (14336, 4096, {}),  # down
        (4096, 128256, {}),  # lm_head
        (4096, 128256, dict(block_n=512, block_k=32)),  # 128256 / 512 = 250.5 strips: ragged N, masked
        (14336, 4096, dict(block_k=512, num_splits=3)),  # uneven splits: a dynamic trip count
        (4000, 1000, dict(block_n=64, block_k=256, num_warps=8, num_stages=4)),  # ragged K and N
    ],
)
def test_skinny_matmul_lowers_for_cuda(K, N, tuning):
    specs = (jax.ShapeDtypeStruct((1, K), BF16), jax.ShapeDtypeStruct((K, N), BF16))
    fn = functools.partial(skinny_matmul, interpret=False, **tuning)
    assert_has_triton_call(lower_for_cuda(fn, *specs))


def lowered_kernels(dtype):
    """Each kernel lowered with its operands in dtype (the skinny GEMV over FP8 weights, whose x
    stays dtype), as small as their tiles allow."""
    F8 = jnp.float8_e4m3fn
    B, H, D, P, S = 4, 8, 64, 9, 16
    x = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, I32)  # noqa: E731
    cache = x(2, P, S, 2, D)
    attention = (cache, cache, i32(), i32(B), i32(B, 2))
    decode = functools.partial(paged_decode, sm_scale=0.1, interpret=False)
    extend = lambda q, k, v, layer, lens, tables, starts, mask: paged_extend(  # noqa: E731
        q, k, v, layer, lens, tables, starts, sm_scale=0.1, max_q_len=4, mask=mask, interpret=False
    )
    mla = functools.partial(mla_decode, kv_lora_rank=32, sm_scale=0.1, interpret=False)
    gemv = functools.partial(skinny_matmul, interpret=False)
    return [
        lower_for_cuda(decode, x(B, H, D), *attention),
        lower_for_cuda(extend, x(B * 4, H, D), *attention, i32(B + 1), jax.ShapeDtypeStruct((B, 4, 4), jnp.bool_)),
        lower_for_cuda(mla, x(B, H, 48), x(2, P, S, 1, 48), i32(), i32(B), i32(B, 2)),
        lower_for_cuda(
            gemv, x(1, 256), jax.ShapeDtypeStruct((256, 128), F8), jax.ShapeDtypeStruct((1, 128), jnp.float32)
        ),
    ]


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_dots_follow_the_default_matmul_precision(dtype):
    """The precision contract at the dots (docs/design-details.md): the kernels' and XLA's FP8
    dot name no precision, so JAX's default matmul precision decides for both. Triton runs a
    float32 dot as TF32 by default and as true f32 (IEEE) at highest (bf16 operands multiply
    exactly whatever it says: it applies to float32 operands only); XLA's dot carries the
    setting in its precision config."""
    from support import precision

    from jspec.layers.quant import fp8_dot_xla

    if precision.emulating_tf32():
        pytest.skip("the TF32 emulation pins every dot it rounds at HIGHEST")
    operand = jnp.dtype(dtype).name.replace("float", "f")  # f32, bf16
    fp8_weight = (jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((1, 128), jnp.float32))
    for setting, triton, xla in ((None, "TF32", "DEFAULT"), ("highest", "IEEE", "HIGHEST")):
        with jax.default_matmul_precision(setting):
            for lowered in lowered_kernels(dtype):
                dots = triton_dots(lowered)
                assert dots and all(dot == (triton, operand) for dot in dots), dots
            text = lower_for_cuda(fp8_dot_xla, jax.ShapeDtypeStruct((2, 256), dtype), *fp8_weight).as_text()
        assert f"precision = [{xla}, {xla}]" in text


@pytest.mark.parametrize("decode_only,tree", [(True, False), (False, True), (False, False)])
def test_windowed_model_forward_lowers_for_cuda(decode_only, tree, monkeypatch):
    """A model whose layers alternate sliding and full attention: the scanned layer loop hands
    each layer's window to the kernels as a traced int32."""
    import jspec.kernels.backend

    monkeypatch.setattr(jspec.kernels.backend, "interpret_mode", lambda: False)  # kernels as on the GPU
    from jspec.checkpoint.loader import param_shapes
    from jspec.models import llama

    monkeypatch.setattr(llama, "one_gpu", lambda: True)  # the layers' one-GPU kernels too (RoPE + K / V write)
    from jspec.config.model import ModelConfig
    from jspec.kvcache.pool import KVPool
    from jspec.layers.batch import AttentionMode, ForwardBatch
    from jspec.models.forward import forward

    cfg = ModelConfig(
        family="mistral",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        sliding_windows=(128, 0, 128, 0),
    )
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, BF16), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )
    B, Q, S, pages = 8, 1 if decode_only else 8, 16, 64
    T = B * Q
    cache = jax.ShapeDtypeStruct((cfg.num_layers, B * pages + 1, S, cfg.num_kv_heads, cfg.head_dim), BF16)
    batch = ForwardBatch(
        *(jax.ShapeDtypeStruct((n,), I32) for n in (T, T, T, B)),
        jax.ShapeDtypeStruct((B, pages), I32),
        jax.ShapeDtypeStruct((B + 1,), I32),
        jax.ShapeDtypeStruct((B,), I32),
    )
    mask = jax.ShapeDtypeStruct((B, Q, Q), jnp.bool_) if tree else None
    mode = AttentionMode(decode_only, Q, "pallas")
    fn = lambda p, kv, b, m: forward(p, cfg, kv, b, mode, mask=m)[1].logits  # noqa: E731
    text = lower_for_cuda(fn, params, KVPool(cache, cache), batch, mask).as_text()
    assert "__gpu$xla.gpu.triton" in text and "stablehlo.while" in text  # the kernels, in the scanned loop
    assert "rope_kv_write_d128" in text

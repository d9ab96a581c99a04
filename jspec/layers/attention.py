"""Paged attention for the model: picks the decode or extend kernel (or its reference)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jspec.distributed.mesh import TENSOR
from jspec.distributed.tensor_parallel import kv_pool_spec
from jspec.kernels.backend import env_choice
from jspec.kernels.mgpu_tiles import GROUP_ROWS
from jspec.kernels.mla_decode import mla_decode, mla_extend
from jspec.kernels.mla_decode_mgpu import mla_decode_mgpu, mla_extend_mgpu
from jspec.kernels.mla_ref import mla_decode_ref, mla_extend_ref
from jspec.kernels.paged_decode import paged_decode
from jspec.kernels.paged_decode_mgpu import paged_decode_mgpu
from jspec.kernels.paged_extend import paged_extend
from jspec.kernels.paged_extend_mgpu import paged_extend_mgpu
from jspec.kernels.ref import paged_decode_ref, paged_extend_ref
from jspec.layers.batch import AttentionMode, ForwardBatch

BACKENDS = ("pallas", "mosaic", "reference")
# mosaic: the Mosaic GPU kernels (kernels/paged_decode_mgpu.py, paged_extend_mgpu.py); what they lack
# is refused by name at the engine's build, and raises MosaicUnsupported at trace time.
DECODE_KERNELS = {"pallas": paged_decode, "mosaic": paged_decode_mgpu, "reference": paged_decode_ref}
EXTEND_KERNELS = {"pallas": paged_extend, "mosaic": paged_extend_mgpu, "reference": paged_extend_ref}
# Absorbed latent attention (MLA): (decode, extend) per backend.
MLA_KERNELS = {
    "pallas": (mla_decode, mla_extend),
    "mosaic": (mla_decode_mgpu, mla_extend_mgpu),
    "reference": (mla_decode_ref, mla_extend_ref),
}


# The decode kernels' split-K count, for experiments (read when a step is traced): by default
# it follows the shape (kernels/paged_tiles.choose_splits); one split writes the output from the
# kernel, with no merge of partials after it (benchmarks/NOTES.md, "add_norm": on the GPU one
# split made both shapes' steps slower, so the shape's choice stays).
DECODE_SPLITS_ENV = "JSPEC_DECODE_SPLITS"


def decode_splits() -> int | None:
    value = os.environ.get(DECODE_SPLITS_ENV)
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{DECODE_SPLITS_ENV}={value!r}: expected a positive number of splits")
    return int(value)


# Where the new tokens' RoPE and K / V write run, for experiments (read when a step is traced):
# "pallas" (the default), one kernel on one GPU under the Triton-backend attention
# (kernels/rope_kv.py); "xla", XLA's ops.
ROPE_KV_ENV = "JSPEC_ROPE_KV"


def rope_kv_backend() -> str:
    return env_choice(ROPE_KV_ENV, "pallas", ("xla", "pallas"))


def mosaic_runs_mla(num_heads: int) -> bool:
    """Whether the Mosaic MLA kernels run for num_heads query heads (per device). A Mosaic program
    multiplies GROUP_ROWS heads at once: with fewer most of each product is padding, and the
    Triton-backend kernels were faster on the GPU (benchmarks/NOTES.md, bench_mla)."""
    return num_heads >= GROUP_ROWS


def mla_kernels_for(backend: str, num_heads: int):
    """MLA's (decode, extend) on this backend; under "mosaic", the Triton-backend kernels where
    mosaic_runs_mla says no."""
    if backend == "mosaic" and not mosaic_runs_mla(num_heads):
        backend = "pallas"
    return MLA_KERNELS[backend]


def paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    batch: ForwardBatch,
    mode: AttentionMode,
    *,
    sm_scale: float,
    mask: jax.Array | None = None,
    window: jax.Array | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """window: the layer's sliding window, an int32 () (None: full attention); logit_softcap:
    Gemma 2's cap on the attention logits; sinks: gpt-oss's per-head sink logits [Hq] (one
    device only: tensor parallelism refuses them, see check_tp_config)."""
    if mode.backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {mode.backend!r}; choose one of {BACKENDS}")
    decode, extend = DECODE_KERNELS[mode.backend], EXTEND_KERNELS[mode.backend]
    windowed = window is not None
    sinked = sinks is not None
    if mode.decode_only and mask is None:
        num_splits = None if mode.backend == "reference" else decode_splits()
        splits = {} if num_splits is None else {"num_splits": num_splits}

        def run_decode(q, k, v, layer, lens, tables, *extra):
            return decode(
                q,
                k,
                v,
                layer,
                lens,
                tables,
                sm_scale=sm_scale,
                window=extra[0] if windowed else None,
                logit_softcap=logit_softcap,
                sinks=extra[-1] if sinked else None,
                **splits,
            )

        extra = ((window,) if windowed else ()) + ((sinks,) if sinked else ())
        return over_head_shards(run_decode, q, k_cache, v_cache, layer, batch.seq_lens, batch.page_tables, *extra)

    def run(q, k, v, layer, lens, tables, starts, *extra):
        return extend(
            q,
            k,
            v,
            layer,
            lens,
            tables,
            starts,
            sm_scale=sm_scale,
            max_q_len=mode.max_q_len,
            mask=extra[0] if tree else None,
            window=extra[int(tree)] if windowed else None,
            logit_softcap=logit_softcap,
            sinks=extra[-1] if sinked else None,
        )

    tree = mask is not None
    extra = (() if mask is None else (mask,)) + ((window,) if windowed else ()) + ((sinks,) if sinked else ())
    return over_head_shards(
        run, q, k_cache, v_cache, layer, batch.seq_lens, batch.page_tables, batch.query_start, *extra
    )


def paged_decode_with_lse(q, k_cache, v_cache, layer, seq_lens, page_tables, *, sm_scale: float, backend: str):
    """Decode attention that also returns the log-sum-exp of each row's logits: (out [B, Hq, D] f32,
    lse [B, Hq] f32, -inf where nothing is visible), so that attention over the paged prefix can
    be merged with attention over keys that live outside the pool (the draft tree's ancestors)."""
    decode = DECODE_KERNELS[backend]
    run = lambda q, k, v, layer, lens, tables: decode(
        q,
        k,
        v,
        layer,
        lens,
        tables,
        sm_scale=sm_scale,  # noqa: E731
        return_lse=True,
    )
    return over_head_shards(run, q, k_cache, v_cache, layer, seq_lens, page_tables, with_lse=True)


def mla_decode_with_lse(q, latent_cache, layer, seq_lens, page_tables, *, kv_lora_rank, sm_scale, backend: str):
    """paged_decode_with_lse for absorbed latent attention (MLA): q [B, Hq, R + P] over a latent
    cache [L, P, S, 1, R + P] whose values are its first R columns -> (out [B, Hq, R] f32, lse)."""
    if backend in ("pallas", "mosaic"):
        kernel = mla_kernels_for(backend, q.shape[1])[0]
        return kernel(
            q, latent_cache, layer, seq_lens, page_tables, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale, return_lse=True
        )
    out, lse = paged_decode_ref(
        q, latent_cache, latent_cache, layer, seq_lens, page_tables, sm_scale=sm_scale, return_lse=True
    )
    return out[..., :kv_lora_rank], lse


def over_head_shards(fn, q, k_cache, v_cache, *replicated, with_lse: bool = False):
    """fn(q [T, Hq, D], k_cache, v_cache [L, P, S, Hkv, D], *replicated) -> out [T, Hq, D]
    (and lse [T, Hq] with_lse), run per tensor-parallel shard on its own heads when the
    current mesh (jax.set_mesh) has a "tensor" axis that divides both head counts; heads
    are independent, so no communication. Otherwise fn runs as is (one device, or a
    replicated draft whose heads do not divide)."""
    mesh = jax.sharding.get_abstract_mesh()
    tp = 1 if mesh.empty or TENSOR not in mesh.axis_names else mesh.shape[TENSOR]
    if tp == 1 or q.shape[1] % tp or k_cache.shape[3] % tp:
        return fn(q, k_cache, v_cache, *replicated)
    heads = P(None, TENSOR, None)
    out_specs = (heads, P(None, TENSOR)) if with_lse else heads
    in_specs = (heads, kv_pool_spec(), kv_pool_spec()) + (P(),) * len(replicated)
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, check_vma=False)(q, k_cache, v_cache, *replicated)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Softmax-merges two attentions over disjoint key sets: out [..., D], lse [...]."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    total = wa + wb
    out = (out_a * wa[..., None] + out_b * wb[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]
    return out


def dense_attention_with_lse(q, k, v, visible, *, sm_scale: float):
    """q [R, Hq, D]; k [R, K, Hkv, D], v [R, K, Hkv, Dv]; visible [R, K] -> (out [R, Hq, Dv] f32,
    lse [R, Hq] f32)."""
    R, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(R, Hkv, Hq // Hkv, D)
    s = jnp.einsum("rhgd,rkhd->rhgk", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) * sm_scale
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(visible[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("rhgk,rkhd->rhgd", p, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(R, Hq, v.shape[-1]), lse.reshape(R, Hq)

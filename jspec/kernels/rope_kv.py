"""RoPE of the new tokens' queries and keys and the write of their keys and values into the
paged pool, in one kernel: Pallas over Triton.

Between a layer's QKV projection and its attention XLA emits four small kernels on the GPU:
the projection's float32 output rounded to the activations' dtype, the rotation of q and k,
and one in-place write per pool leaf (K and V). At decode batch sizes each moves a few
kilobytes, so each costs what a launch costs, and a small model's step is made of such
launches (benchmarks/NOTES.md, "bench_host_launch"). Here one program per token reads its
projection row once, rotates q and k, writes q out and k and v into their pool slot.

The arithmetic is the reference's, in its order: the row is rounded to the activations'
dtype first, each q and k head RMS-normed where the model norms them (Qwen3's q_norm / k_norm),
rotated in float32 (x1 c - x2 s, x2 c + x1 s over HF's half split) and rounded again. Slots past the pool (the padding convention, slot = pages * page_size) write nothing.
The pool leaves are aliased to the outputs: inside a step that donates its pool the write
is in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jspec.kernels.backend import resolve_interpret
from jspec.kernels.paged_tiles import check_pow2, next_pow2
from jspec.kernels.rms_norm import rms_norm


def rope_kv_write_ref(
    qkv, cos, sin, k_cache, v_cache, layer, slots, norms=None, *, num_heads: int, num_kv_heads: int, dtype, eps=1e-6
):
    """qkv [T, (Hq + 2 Hkv) D] (a projection's output, q's heads then k's then v's), cos / sin
    [T, D / 2] -> (q [T, Hq, D] rotated, in dtype; k_cache and v_cache [L, P, S, Hkv, D] with
    token t's rotated k and its v at flat slot slots[t] of layer). norms: (q_norm, k_norm) [D]
    in dtype, each head RMS-normed by them (eps) before its rotation; None: none."""
    T, D, S = qkv.shape[0], k_cache.shape[-1], k_cache.shape[2]
    heads = qkv.astype(dtype).reshape(T, num_heads + 2 * num_kv_heads, D)
    q, k = heads[:, :num_heads], heads[:, num_heads : num_heads + num_kv_heads]
    if norms is not None:
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    rotated = jnp.concatenate([q, k], axis=1).astype(jnp.float32)
    x1, x2 = rotated[..., : D // 2], rotated[..., D // 2 :]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(dtype)
    q, k, v = rotated[:, :num_heads], rotated[:, num_heads:], heads[:, num_heads + num_kv_heads :]

    def write(cache, new):
        return cache.at[layer, slots // S, slots % S].set(new.astype(cache.dtype), mode="drop")

    return q, write(k_cache, k), write(v_cache, v)


def _rope_kv_kernel(layer_ref, slots_ref, qkv_ref, cos_ref, sin_ref, *refs, normed, eps, **dims):
    if normed:
        q_norm_ref, k_norm_ref, _k_in, _v_in, q_ref, k_ref, v_ref = refs
    else:
        _k_in, _v_in, q_ref, k_ref, v_ref = refs  # the inputs aliased to k_ref and v_ref: written through those
    num_heads, num_kv_heads, dtype = dims["num_heads"], dims["num_kv_heads"], dims["dtype"]
    pages, page_size, head_dim = k_ref.shape[1], k_ref.shape[2], k_ref.shape[-1]
    t = pl.program_id(0)
    half = lax.iota(jnp.int32, head_dim // 2)[None, :]
    cos = pltriton.load(cos_ref.at[t, half])
    sin = pltriton.load(sin_ref.at[t, half])

    def load_heads(first, count):
        rows = lax.iota(jnp.int32, next_pow2(count))[:, None]
        real = rows < count
        lo, hi = (
            pltriton.load(qkv_ref.at[t, first + rows, half + off], mask=real, other=0).astype(dtype)
            for off in (0, head_dim // 2)
        )
        return rows, real, lo, hi

    def norm(lo, hi, weight_ref):
        # rms_norm's order: the head's mean square in f32, the scaled head rounded, then the weight.
        lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
        square = jnp.sum(lo * lo, axis=1, keepdims=True) + jnp.sum(hi * hi, axis=1, keepdims=True)
        inv = lax.rsqrt(square / head_dim + eps)
        return (
            (
                pltriton.load(weight_ref.at[half + off]).astype(jnp.float32)
                * (x * inv).astype(dtype).astype(jnp.float32)
            ).astype(dtype)
            for off, x in ((0, lo), (head_dim // 2, hi))
        )

    def rotate(lo, hi, weight_ref):
        if normed:
            lo, hi = norm(lo, hi, weight_ref)
        lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
        return (lo * cos - hi * sin).astype(dtype), (hi * cos + lo * sin).astype(dtype)

    rows, real, lo, hi = load_heads(0, num_heads)
    q_lo, q_hi = rotate(lo, hi, q_norm_ref if normed else None)
    pltriton.store(q_ref.at[t, rows, half], q_lo, mask=real)
    pltriton.store(q_ref.at[t, rows, half + head_dim // 2], q_hi, mask=real)

    slot = slots_ref[t]
    kept = (slot >= 0) & (slot < pages * page_size)
    page = jnp.where(kept, slot // page_size, 0)  # a dropped token's indices stay in bounds
    offset = jnp.where(kept, slot % page_size, 0)
    layer = layer_ref[0]
    rows, real, lo, hi = load_heads(num_heads, num_kv_heads)
    k_lo, k_hi = rotate(lo, hi, k_norm_ref if normed else None)
    _, _, v_lo, v_hi = load_heads(num_heads + num_kv_heads, num_kv_heads)
    write = real & kept
    for ref, (a, b) in ((k_ref, (k_lo, k_hi)), (v_ref, (v_lo, v_hi))):
        pltriton.store(ref.at[layer, page, offset, rows, half], a.astype(ref.dtype), mask=write)
        pltriton.store(ref.at[layer, page, offset, rows, half + head_dim // 2], b.astype(ref.dtype), mask=write)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "dtype", "eps", "interpret"))
def rope_kv_write(
    qkv,
    cos,
    sin,
    k_cache,
    v_cache,
    layer,
    slots,
    norms=None,
    *,
    num_heads: int,
    num_kv_heads: int,
    dtype,
    eps: float = 1e-6,
    interpret=None,
):
    """rope_kv_write_ref's result from one kernel: q [T, Hq, D] in dtype and the two pool leaves
    with the new tokens' k (rotated) and v written at their slots."""
    T, D = qkv.shape[0], k_cache.shape[-1]
    check_pow2("head_dim", D)
    if qkv.shape != (T, (num_heads + 2 * num_kv_heads) * D) or cos.shape != (T, D // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"rope_kv_write takes qkv [T, (Hq + 2 Hkv) D] and cos / sin [T, D / 2] (full rotary), got "
            f"{qkv.shape}, {cos.shape}, {sin.shape} for Hq {num_heads}, Hkv {num_kv_heads}, D {D}"
        )
    if k_cache.shape[-2:] != (num_kv_heads, D) or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_kv_write: pool leaves {k_cache.shape}, {v_cache.shape} for Hkv {num_kv_heads}, D {D}")
    if norms is not None and any(w.shape != (D,) or w.dtype != jnp.dtype(dtype) for w in norms):
        raise ValueError(
            f"rope_kv_write: q / k norm weights {[(w.shape, w.dtype) for w in norms]}, want [{D}] in {dtype}"
        )
    heads = qkv.reshape(T, num_heads + 2 * num_kv_heads, D)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kernel = functools.partial(
        _rope_kv_kernel, normed=norms is not None, eps=eps, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype
    )
    weights = () if norms is None else tuple(norms)
    first_pool = 5 + len(weights)
    return pl.pallas_call(
        kernel,
        grid=(T,),
        out_shape=(
            jax.ShapeDtypeStruct((T, num_heads, D), dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        input_output_aliases={first_pool: 1, first_pool + 1: 2},
        interpret=resolve_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name=f"rope_kv_write_d{D}",
    )(
        layer,
        slots.astype(jnp.int32),
        heads,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        *weights,
        k_cache,
        v_cache,
    )

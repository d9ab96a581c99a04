"""Building blocks shared by the Mosaic GPU paged attention kernels (decode and extend).

Both kernels run one warpgroup per program over a block of GROUP_ROWS query rows (a GQA group,
or tokens x group) padded with zeros, read KV by TMA one page (or one tile of a longer page) per
copy into swizzled shared memory, and run the online softmax in registers in wgmma's layout.
What they cover is the same (16-bit and FP8 pools, FP8 tiles upcast in shared memory; pages of
MIN_PAGE_SIZE or more, head_dim a multiple of 64 up to 256; sliding windows, soft-caps and
sinks); anything else raises MosaicUnsupported.

The shapes of a tile step follow what Mosaic GPU's interpreter (the CPU test path) can run: see
docs/kernels-mosaic.md and each kernel's docstring.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jspec.kernels.backend import resolve_interpret
from jspec.kernels.paged_tiles import FP8_KV, FP8_KV_BYTES, LOG2E, MASK_VALUE

# wgmma multiplies 64-row blocks: a program's query rows are padded to this.
GROUP_ROWS = 64
# A TMA copy into a tiled, swizzled buffer fills whole 8-row tiles.
MIN_PAGE_SIZE = 8
# Hopper's shared memory per block (opt-in); Mosaic GPU assumes it too when no GPU is attached.
SMEM_BYTES = 227 * 1024
KV_DTYPES = (jnp.bfloat16, jnp.float16)
# An FP8 tile's wgmma dtype: Hopper converts e4m3 to f16 in one step, to bf16 only through f32.
FP8_COMPUTE = jnp.float16
# A tree mask's row travels as bits: one int32 word per this many new tokens.
MASK_WORD_BITS = 32
# KV tokens per tile: wgmma's N for the logits. Fewer than 64 fail Mosaic GPU's layout inference
# (jax 0.11.2); more than 256 exceed wgmma's N.
BLOCK_N_CHOICES = (64, 128, 256)


class MosaicUnsupported(NotImplementedError):
    """A call a Mosaic GPU kernel does not cover; feature names what (for a fallback's log)."""

    def __init__(self, feature: str, kernel: str = "decode"):
        super().__init__(f"the Mosaic GPU {kernel} kernel does not support {feature}")
        self.feature = feature
        self.kernel = kernel


def paged_unsupported(cache_shape, cache_dtype, num_q_heads, *, num_warps) -> str | None:
    """The first feature of a paged attention call that the Mosaic kernels lack, or None."""
    _, _, page_size, num_kv_heads, head_dim = cache_shape
    dtype = jnp.dtype(cache_dtype)
    if dtype != FP8_KV_BYTES and dtype not in map(jnp.dtype, KV_DTYPES):
        # wgmma reads 32-bit operands K-major only, and a V tile is N-major.
        return f"a {dtype.name} KV pool (16-bit or FP8 pools only)"
    if page_size < MIN_PAGE_SIZE or page_size & (page_size - 1):
        return f"page size {page_size} (powers of two from {MIN_PAGE_SIZE})"
    if head_dim % 64 or head_dim > 256:
        # A row of a 128-byte swizzle holds 64 16-bit values; the values wgmma's N is at most 256.
        return f"head_dim {head_dim} (64, 128, 192 or 256)"
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > GROUP_ROWS:
        return f"{num_q_heads} query heads over {num_kv_heads} kv heads (groups of at most {GROUP_ROWS})"
    if num_warps != 4:
        return f"num_warps {num_warps} (a program is one warpgroup: 4)"
    return None


def check_block_n(block_n: int) -> None:
    if block_n not in BLOCK_N_CHOICES:
        raise ValueError(f"block_n must be one of {BLOCK_N_CHOICES}, got {block_n}")


def wgmma_dtype(kv_dtype):
    """The dtype a pool's attention multiplies in (q, p and the K / V tiles): the pool's, or
    FP8_COMPUTE over an FP8 pool (its byte tiles upcast in shared memory)."""
    return FP8_COMPUTE if jnp.dtype(kv_dtype) == FP8_KV_BYTES else kv_dtype


def tile_smem_bytes(head_dim: int, block_n: int, num_stages: int, kv_dtype=jnp.bfloat16) -> int:
    """Shared memory of a tile loop: the query block, num_stages K and V tiles, and p; over an
    FP8 pool the tiles are bytes, plus one K and one V tile upcast to 16 bits."""
    tiles = 2 * num_stages * block_n * head_dim * jnp.dtype(kv_dtype).itemsize
    upcast = 2 * block_n * head_dim * 2 if jnp.dtype(kv_dtype) == FP8_KV_BYTES else 0
    return tiles + upcast + 2 * (GROUP_ROWS * head_dim + GROUP_ROWS * block_n)


def upcast_tiles_smem(block_n: int, head_dim: int, kv_dtype) -> list:
    """The shared memory upcast_kv_tiles writes to: a K and a V tile over an FP8 pool, else none."""
    if jnp.dtype(kv_dtype) != FP8_KV_BYTES:
        return []
    dtype = wgmma_dtype(kv_dtype)
    return [plgpu.SMEM((block_n, head_dim), dtype, transforms=swizzled(head_dim, dtype)) for _ in range(2)]


def upcast_kv_tiles(k_bytes, v_bytes, v_barrier, k_16, v_16):
    """An FP8 slot's K and V tiles in shared memory (e4m3 bytes; V waited for first) written to
    the 16-bit tiles k_16 and v_16, for wgmma; returns those. The caller's previous tile is done
    with them: attend_kv_tile reads both wgmmas' results out before it returns."""
    k_16[...] = lax.bitcast_convert_type(k_bytes[...], FP8_KV).astype(k_16.dtype)
    plgpu.barrier_wait(v_barrier)
    v_16[...] = lax.bitcast_convert_type(v_bytes[...], FP8_KV).astype(v_16.dtype)
    plgpu.commit_smem()
    return k_16, v_16


def mask_word_bits(mask, words: int):
    """A boolean mask [..., Q] as int32 words [..., words], bit k of word w the mask at w *
    MASK_WORD_BITS + k (made in jnp, read in a kernel by seen_or_in_words)."""
    width = words * MASK_WORD_BITS
    rows = jnp.pad(mask.astype(bool), [(0, 0)] * (mask.ndim - 1) + [(0, width - mask.shape[-1])])
    rows = rows.reshape(*mask.shape[:-1], words, MASK_WORD_BITS)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(MASK_WORD_BITS, dtype=jnp.uint32))
    return lax.bitcast_convert_type(
        jnp.sum(jnp.where(rows, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32), jnp.int32
    )


def seen_or_in_words(seen, new_token, word_values):
    """In a kernel: seen, or'd with whether each new_token (an array of positions among the new
    tokens; negative ones are not new) has its bit set, word_values[w] holding word w's bits
    shaped like new_token (mask_word_bits' layout)."""
    for word, bits in enumerate(word_values):
        bit = jnp.clip(new_token - word * MASK_WORD_BITS, 0, MASK_WORD_BITS - 1)
        in_word = (new_token >= word * MASK_WORD_BITS) & (new_token < (word + 1) * MASK_WORD_BITS)
        seen |= in_word & ((lax.shift_right_logical(bits, bit) & 1) != 0)
    return seen


def interpret_params(interpret) -> plgpu.InterpretGPUParams | None:
    """A kernel's interpret argument as plgpu.kernel takes it: the interpreter's own settings (race
    detection, say) pass through; None and bools follow backend.py, as every kernel's do."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if resolve_interpret(interpret) else None


def swizzled(cols: int, dtype) -> tuple:
    """Shared-memory transforms of a wgmma operand whose rows hold cols elements of dtype."""
    swizzle = min(128, cols * jnp.dtype(dtype).itemsize)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def issue_kv_tile(
    k_ref,
    v_ref,
    page_tables_ref,
    k_smem,
    v_smem,
    k_barriers,
    v_barriers,
    *,
    seq,
    kv_head,
    layer,
    start,
    hi,
    slot,
    page_size,
    num_pages,
    block_n,
    rows_per_copy,
):
    """TMA copies of KV positions start..start+block_n of one sequence and kv head into a slot.

    k_ref, v_ref: the pools as [L * P, S, H, D] (layer and page in one index). One copy per page,
    or per rows_per_copy tokens of a longer page; each arrives on the slot's barrier. A copy at or
    past hi reads the layer's page 0 instead (past the end the table holds anything): every copy
    is issued, as a predicated one would not run in the interpreter, and the caller masks it.
    """
    max_pages = page_tables_ref.shape[1]
    for j in range(block_n // rows_per_copy):
        first = start + j * rows_per_copy
        page = page_tables_ref[seq, jnp.minimum(lax.div(first, page_size), max_pages - 1)]
        row = layer * num_pages + jnp.where(first < hi, page, 0)
        offset = pl.multiple_of(lax.rem(first, page_size), rows_per_copy) if page_size > rows_per_copy else 0
        src = (row, pl.ds(offset, rows_per_copy), kv_head)
        dst = (slot, pl.ds(j * rows_per_copy, rows_per_copy))
        plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[dst], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[dst], v_barriers.at[slot])


def initial_rows(head_dim: int):
    """The online-softmax carry (m, l, acc) of GROUP_ROWS rows that have seen nothing, in wgmma's
    register layout."""
    rows = plgpu.Layout.WGMMA.reduce(1)
    return (
        plgpu.layout_cast(jnp.full((GROUP_ROWS,), MASK_VALUE, jnp.float32), rows),
        plgpu.layout_cast(jnp.zeros((GROUP_ROWS,), jnp.float32), rows),
        plgpu.layout_cast(jnp.zeros((GROUP_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
    )


def split_sink_rows(sink_rows, num_splits: int):
    """Each context split's initial running max (log2 units) of rows whose sink logits (natural
    units) are sink_rows: [num_splits, *sink_rows.shape], the sinks in the first split, so that
    the merge counts them once, nothing in the others. Made in jnp: a select on the split index
    inside a kernel is a scalar broadcast, which Mosaic GPU does not lower."""
    first = (jnp.arange(num_splits) == 0).reshape(-1, *(1,) * sink_rows.ndim)
    return jnp.where(first, sink_rows.astype(jnp.float32)[None] * LOG2E, MASK_VALUE)


def rows_after_sinks(sink_smem, head_dim: int):
    """The online-softmax carry (m, l, acc) of GROUP_ROWS rows that have seen only their sink: a
    key of that logit and value zero (split_sink_rows' running max, loaded from sink_smem, with
    normaliser 1). In the splits after the first the max is MASK_VALUE, a key of weight zero that
    the first real key or the merge wipes out."""
    rows = plgpu.Layout.WGMMA.reduce(1)
    ones = plgpu.layout_cast(jnp.ones((GROUP_ROWS,), jnp.float32), rows)
    return plgpu.load(sink_smem, layout=rows), ones, initial_rows(head_dim)[2]


def attend_kv_tile(
    q_smem,
    k_tile,
    v_tile,
    v_barrier,
    p_smem,
    carry,
    *,
    start,
    hi,
    scale_log2,
    visible=None,
    check_hi=True,
    lo=None,
    softcap=None,
):
    """One online-softmax step of the query block q_smem [GROUP_ROWS, D] over a K / V tile in
    shared memory (K already waited for; V waited for here, after the logits, unless v_barrier is
    None: values that came with the keys). Returns (m, l, acc).

    start: the tile's first KV position; hi: positions from hi on are outside this program's range.
    With check_hi (a tile that may reach hi) they are hidden and their values zeroed in shared
    memory: a NaN there would survive a zero weight. lo: None, or positions below it are hidden
    and zeroed likewise (a sliding window's start), which implies check_hi. visible: None, or a
    function of the logits' positions (an iota along the tile) giving what each row sees below
    hi, which implies check_hi; what it hides gets weight exactly zero. softcap: the scaled
    logits (natural units) become softcap * tanh(logits / softcap), as Gemma 2's.
    """
    m, l, acc = carry
    block_n, head_dim = v_tile.shape
    check_hi = check_hi or visible is not None or lo is not None

    def logits(s_ref):
        plgpu.wgmma(s_ref, q_smem, k_tile.T)
        return s_ref[...]

    s = pl.run_scoped(logits, plgpu.ACC((GROUP_ROWS, block_n), jnp.float32))
    if softcap is None:
        s = s * scale_log2
    else:
        s = jnp.tanh(s * (scale_log2 / (LOG2E * softcap))) * (softcap * LOG2E)
    if check_hi:
        positions = start + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        seen = positions < hi
        if lo is not None:
            seen &= positions >= lo
        if visible is not None:
            seen &= visible(positions)
        s = jnp.where(seen, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    if visible is not None or lo is not None:
        # A row that has seen nothing yet has m_new == MASK_VALUE and p == 1 where hidden.
        p = jnp.where(seen, p, 0.0)
    l = l * alpha + p.sum(axis=1)
    if v_barrier is not None:
        plgpu.barrier_wait(v_barrier)
    if check_hi:
        below = jnp.int32(0) if lo is None else lo

        @pl.when((start + block_n > hi) | (start < below))
        def _zero_values_out_of_range():
            rows = start + plgpu.broadcasted_iota(jnp.int32, (block_n, head_dim), 0, layout=plgpu.Layout.WGMMA)
            v_tile[...] = jnp.where((rows < hi) & (rows >= below), v_tile[...], 0).astype(v_tile.dtype)

    p_smem[...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()

    def values(o_ref):
        plgpu.wgmma(o_ref, p_smem, v_tile)
        return o_ref[...]

    pv = pl.run_scoped(values, plgpu.ACC((GROUP_ROWS, head_dim), jnp.float32))
    return m_new, l, acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

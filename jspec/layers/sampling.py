"""Token sampling on the device, every row with its own parameters.

Rows with temperature 0 take the argmax, so greedy and sampled requests share
one batch and one compiled program. A sampled row draws with the Gumbel-max
trick from a key made of its request's seed and the position of the token
being sampled, so a seeded request gets the same tokens whatever else is in
the batch, and whichever step (or re-prefill after retraction) samples them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Columns of SamplingRows.params (penalties.py reads the last three).
TEMPERATURE, TOP_K, TOP_P, MIN_P, FREQUENCY, PRESENCE, REPETITION = range(7)
NUM_PARAMS = 7


class SamplingRows(NamedTuple):
    """Per-row sampling parameters, packed into two arrays (few leaves: cheap dispatch)."""

    params: jax.Array  # [B, 7] float32: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off),
    # frequency, presence (0 = off) and repetition (1 = off) penalties
    seeds: jax.Array  # [B] uint32


def sampling_rows(params_list, seeds, rows: int) -> SamplingRows:
    """Host side: numpy SamplingRows for `rows` rows from SamplingParams (padding rows are greedy)."""
    out = np.zeros((rows, NUM_PARAMS), np.float32)
    out[:, TOP_P] = 1.0
    out[:, REPETITION] = 1.0
    for i, p in enumerate(params_list):
        out[i] = (
            p.temperature,
            p.top_k,
            p.top_p,
            p.min_p,
            p.frequency_penalty,
            p.presence_penalty,
            p.repetition_penalty,
        )
    s = np.zeros(rows, np.uint32)
    s[: len(seeds)] = seeds
    return SamplingRows(out, s)


# Which filter a row's top-k / top-p / min-p keep: every filter keeps an upper set of the row's
# logits (if a token is kept, so is every token with a larger logit), so a row's kept set is
# {x >= threshold} and finding the threshold replaces sorting the vocabulary:
#   count(x > x_i) < top_k,   mass(x > x_i) < top_p,   x_i - max(x) >= log(min_p).
# Tokens with equal logits are kept or dropped together (as vLLM's threshold top-k does).
TOP_K_CAP = 128  # method "candidates" finds thresholds among each row's 128 largest logits
_GROUP = 32  # ... which lie in the 128 groups of 32 logits with the largest maxima
SEARCH_BITS = 1  # method "search" settles this many bits of the threshold per pass over the row
SEARCH_SPLITS = 1  # ... reading each row as this many pieces


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats have their bits flipped)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(0x80000000))


def _float_of_key(key: jax.Array) -> jax.Array:
    b = jnp.where(key >> 31 == 1, key ^ jnp.uint32(0x80000000), ~key)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _top_k_top_p_threshold_from_candidates(x: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """x [R, V] scaled logits -> [R] threshold for rows with 1 <= top_k <= TOP_K_CAP (-inf where
    top_k <= 0: no top-k, and then no top-p either, as keep_mask guarantees). The row's TOP_K_CAP
    largest logits lie in the TOP_K_CAP groups with the largest maxima (a group whose maximum ranks
    below that has TOP_K_CAP larger logits elsewhere), so a max per group, a top-k over the group
    maxima and a sort of TOP_K_CAP * _GROUP candidates stand in for a sort of the vocabulary."""
    R, V = x.shape
    cap = min(TOP_K_CAP, V)
    if V > TOP_K_CAP * _GROUP:
        G = -(-V // _GROUP)
        groups = jnp.pad(x, ((0, 0), (0, G * _GROUP - V)), constant_values=-jnp.inf).reshape(R, G, _GROUP)
        _, best = jax.lax.top_k(groups.max(axis=-1), cap)
        x_cand = jnp.take_along_axis(groups, best[:, :, None], axis=1).reshape(R, cap * _GROUP)
    else:
        x_cand = x
    top = jax.lax.top_k(x_cand, cap)[0]  # [R, cap], descending
    m = top[:, :1]
    z = jnp.exp(x - m).sum(axis=-1, keepdims=True)
    p = jnp.exp(top - m) / z
    above = top[:, None, :] > top[:, :, None]  # [R, i, j]: candidate j's logit exceeds candidate i's
    kept = (above.sum(-1) < top_k[:, None]) & (
        (jnp.where(above, p[:, None, :], 0.0).sum(-1) < top_p[:, None]) | (top_p[:, None] >= 1)
    )
    tau = jnp.min(jnp.where(kept, top, jnp.inf), axis=-1)
    return jnp.where(top_k >= 1, tau, -jnp.inf)


def _top_k_top_p_threshold_by_search(
    x: jax.Array, top_k: jax.Array, top_p: jax.Array, bits: int, splits: int = SEARCH_SPLITS
) -> jax.Array:
    """x [R, V] -> [R] threshold for any top_k / top_p: the smallest float32 v with
    count(x > v) < top_k and mass(x > v) < top_p (both fall as v grows), found digit by digit
    over v's order key, `bits` bits per pass: 32 / bits passes, each over the whole row. Each
    row is read as `splits` pieces, so a pass runs R * splits reductions in parallel, not R."""
    R, V = x.shape
    m = x.max(axis=-1, keepdims=True)
    z = jnp.exp(x - m).sum(axis=-1, keepdims=True)
    width = -(-V // splits)
    x = jnp.pad(x, ((0, 0), (0, width * splits - V)), constant_values=-jnp.inf).reshape(R, splits, width)
    k = jnp.where(top_k > 0, top_k, jnp.inf)[:, None]
    lowest, highest = _order_key(jnp.float32(-jnp.inf)), _order_key(jnp.float32(jnp.inf))
    base = jnp.zeros(x.shape[0], jnp.uint32)  # every key below base fails
    steps = jnp.arange(1, 2**bits, dtype=jnp.uint32)

    def settle_digit(d, base):
        shift = jnp.uint32(32 - bits * (d + 1))
        keys = base[:, None] + (steps[None, :] << shift) - 1  # [R, J], never wraps: base's low bits are 0
        v = _float_of_key(keys)
        over = x[:, None] > v[:, :, None, None]  # [R, J, splits, width], fused into the two reductions
        # exp inside the masked sum: each pass reads x alone, not x and a stored exp(x - m).
        mass = jnp.exp(jnp.where(over, (x - m[:, :, None])[:, None], -jnp.inf)).sum(-1).sum(-1)
        ok = (over.sum(-1).sum(-1) < k) & ((mass < top_p[:, None] * z) | (top_p[:, None] >= 1))
        ok = jnp.where(keys < lowest, False, jnp.where(keys > highest, True, ok))
        return base + ((~ok).sum(-1).astype(jnp.uint32) << shift)  # ok is monotone in the key

    # Unrolled on the GPU, the form bench_sampling timed there; a loop elsewhere, where compile
    # time dominates (a CPU program with the search compiles in 0.9 s instead of 2.5 s).
    base = jax.lax.fori_loop(0, 32 // bits, settle_digit, base, unroll=jax.default_backend() == "gpu")
    return _float_of_key(base)


def keep_mask(
    x: jax.Array,
    params: jax.Array,
    method: str = "auto",
    search_bits: int = SEARCH_BITS,
    search_splits: int = SEARCH_SPLITS,
) -> jax.Array:
    """x [R, V] temperature-scaled logits -> [R, V] bool: the tokens top-k, top-p and min-p keep.

    method "search" finds every row's threshold by the bit search (any filter); "candidates"
    among the largest logits (rows with 1 <= top_k <= TOP_K_CAP, or no top-k / top-p at all);
    "auto" picks per batch: on the GPU always the search, since a branch on the data costs it a
    host round trip; elsewhere the cheapest method that covers every row, or none when no row
    filters by top-k / top-p (temperature-only sampling then reads the row once)."""
    top_k, top_p = params[:, TOP_K].astype(jnp.int32), params[:, TOP_P]
    search = lambda: _top_k_top_p_threshold_by_search(x, top_k, top_p, search_bits, search_splits)  # noqa: E731
    candidates = lambda: _top_k_top_p_threshold_from_candidates(x, top_k, top_p)  # noqa: E731
    if method == "search" or (method == "auto" and jax.default_backend() == "gpu"):
        tau = search()
    elif method == "candidates":
        tau = candidates()
    else:
        sampled = params[:, TEMPERATURE] > 0
        wide = sampled & ((top_p < 1) | (top_k > TOP_K_CAP))
        narrow = sampled & (top_k >= 1)
        none = lambda: jnp.full(x.shape[:1], -jnp.inf, x.dtype)  # noqa: E731
        tau = jax.lax.cond(jnp.any(wide), search, lambda: jax.lax.cond(jnp.any(narrow), candidates, none))
    m = x.max(axis=-1, keepdims=True)
    return (x >= tau[:, None]) & (x - m >= jnp.log(params[:, MIN_P])[:, None])


def apply_vocab_mask(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    """logits [R, V] with the tokens a row's bitmask [R, ceil(V / 32)] int32 leaves out set to
    -inf (bit t % 32 of word t // 32 allows token t); None: unchanged. Sampling and logprobs
    after it are the distribution renormalised over the allowed tokens."""
    if mask is None:
        return logits
    R, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (jax.lax.bitcast_convert_type(mask, jnp.uint32)[:, :, None] >> shifts) & 1
    allowed = bits.reshape(R, -1)[:, :V].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


# A batch's sampling is one of two programs, chosen on the host from its requests' SamplingParams
# (a static argument of the steps): "greedy" = argmax only; "sampled" = per-row temperature,
# top-k, top-p and min-p (greedy rows stay argmax). A row gets the same token whichever program
# runs it (the noise belongs to the token id, and every threshold method keeps the same tokens),
# so a seeded request's output does not depend on what it is batched with.
SAMPLING_MODES = ("greedy", "sampled")


def sampling_mode(params_list) -> str:
    """The program that samples every SamplingParams in params_list exactly."""
    return "sampled" if any(p.temperature > 0 for p in params_list) else "greedy"


def sample_tokens(logits: jax.Array, rows: SamplingRows, positions: jax.Array, mode: str = "sampled") -> jax.Array:
    """logits [B, V]; positions [B]: the sequence position of the token being sampled -> [B] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(row_keys(rows.seeds, positions))
    t = rows.params[:, TEMPERATURE]
    x = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[:, None]
    x = jnp.where(keep_mask(x, rows.params), x, -jnp.inf)
    sampled = jnp.argmax(x + gumbel, axis=-1).astype(jnp.int32)
    return jnp.where(t > 0, sampled, greedy)


def token_logprobs(logits: jax.Array, rows: SamplingRows, tokens: jax.Array, top_n: int):
    """Log-probabilities after the temperature transform (as SGLang reports them; a greedy row
    uses temperature 1): (logprob of tokens [R], top_n ids [R, top_n], their logprobs [R, top_n])."""
    t = rows.params[:, TEMPERATURE]
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)[:, None], axis=-1)
    chosen = jnp.take_along_axis(lsm, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if top_n == 0:
        return chosen, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(lsm, top_n)
    return chosen, top_ids.astype(jnp.int32), top_lp

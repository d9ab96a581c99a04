"""The ragged token batch every model forward runs on.

Prefill chunks and decode tokens of different requests share one flat token
array. Sequence b owns rows query_start[b]:query_start[b+1]; those tokens are
the last qlen_b of its seq_lens[b] KV entries (their K/V are written before
attention runs). Rows past query_start[-1] are padding: their slot is out of
range, so their KV writes are dropped, and their outputs are ignored.
"""

from __future__ import annotations

from typing import NamedTuple

import jax


class ForwardBatch(NamedTuple):
    tokens: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, RoPE position of each token
    slots: jax.Array  # [T] int32, flat KV slot page*page_size+offset; padding: pages*page_size
    seq_lens: jax.Array  # [B] int32, KV length of each sequence after this step
    page_tables: jax.Array  # [B, max_pages] int32
    query_start: jax.Array  # [B+1] int32, cumulative new-token counts
    logits_indices: jax.Array  # [N] int32, rows of the token array whose logits are wanted


class AttentionMode(NamedTuple):
    """Static facts about a batch that pick the attention kernel and its tiling."""

    decode_only: bool  # every sequence has exactly one new token, T == B
    max_q_len: int  # bucket bound on any sequence's new-token count
    backend: str = "pallas"  # "pallas" kernels or the pure-jnp "reference"


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()

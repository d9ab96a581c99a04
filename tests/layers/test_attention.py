"""The attention layer's dispatch: which decode kernel runs, with which split-K count."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.layers import attention
from jspec.layers.batch import AttentionMode, ForwardBatch


def decode_batch(B=2, pages=2, page_size=4):
    tables = np.arange(B * pages, dtype=np.int32).reshape(B, pages)
    return ForwardBatch(
        tokens=jnp.zeros(B, jnp.int32),
        positions=jnp.full(B, 5, jnp.int32),
        slots=jnp.arange(B, dtype=jnp.int32),
        seq_lens=jnp.full(B, 6, jnp.int32),
        page_tables=jnp.asarray(tables),
        query_start=jnp.arange(B + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(B, dtype=jnp.int32),
    )


@pytest.mark.parametrize("setting,expected", [(None, None), ("1", 1), ("4", 4)])
def test_the_decode_split_count_reaches_the_kernel(monkeypatch, setting, expected):
    """JSPEC_DECODE_SPLITS, when set, is the decode kernel's num_splits (one split: no merge of
    partials after the kernel); unset, the kernel picks from the shape."""
    seen = {}

    def spy(q, *args, **kw):
        seen.update(kw)
        return q

    monkeypatch.setitem(attention.DECODE_KERNELS, "pallas", spy)
    if setting is None:
        monkeypatch.delenv(attention.DECODE_SPLITS_ENV, raising=False)
    else:
        monkeypatch.setenv(attention.DECODE_SPLITS_ENV, setting)
    B, Hq, Hkv, D = 2, 4, 2, 8
    cache = jnp.zeros((1, 4, 4, Hkv, D), jnp.float32)
    q = jnp.ones((B, Hq, D), jnp.float32)
    mode = AttentionMode(decode_only=True, max_q_len=1, backend="pallas")
    attention.paged_attention(q, cache, cache, jnp.int32(0), decode_batch(B), mode, sm_scale=0.1)
    assert seen.get("num_splits") == expected


def test_a_split_count_that_is_not_a_positive_number_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(attention.DECODE_SPLITS_ENV, "0")
    with pytest.raises(ValueError, match="JSPEC_DECODE_SPLITS='0'"):
        attention.decode_splits()
    monkeypatch.setenv(attention.DECODE_SPLITS_ENV, "many")
    with pytest.raises(ValueError, match="positive number of splits"):
        attention.decode_splits()

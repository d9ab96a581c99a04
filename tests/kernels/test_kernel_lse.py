"""paged_decode(return_lse=True) equals its reference, split or not: the draft tree's
attention merges the paged prefix with the beam's own ancestors through this LSE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.precision import tolerance

from jspec.kernels.paged_decode import paged_decode
from jspec.kernels.ref import paged_decode_ref
from jspec.layers.attention import dense_attention_with_lse, merge_attention


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_lse_matches_reference(num_splits):
    ks = jax.random.split(jax.random.key(0), 3)
    L, P, S, H, D = 2, 24, 16, 2, 64
    kc, vc = jax.random.normal(ks[0], (L, P, S, H, D)), jax.random.normal(ks[1], (L, P, S, H, D))
    q = jax.random.normal(ks[2], (3, 8, D))
    pt = jnp.array([[1, 2, 3, 4, 11], [5, 6, 0, 0, 0], [7, 8, 9, 10, 12]], jnp.int32)
    sl = jnp.array([50, 0, 80], jnp.int32)
    out, lse = paged_decode(
        q, kc, vc, jnp.int32(1), sl, pt, sm_scale=0.125, return_lse=True, num_splits=num_splits, min_split_tokens=16
    )
    ref_out, ref_lse = paged_decode_ref(q, kc, vc, jnp.int32(1), sl, pt, sm_scale=0.125, return_lse=True)
    tol = tolerance()
    np.testing.assert_allclose(out, ref_out, rtol=tol.rtol, atol=tol.atol)
    np.testing.assert_allclose(lse, ref_lse, rtol=tol.rtol, atol=tol.lse_atol)
    assert np.all(np.isneginf(lse[1]))


def test_merging_two_halves_equals_attention_over_all():
    ks = jax.random.split(jax.random.key(1), 3)
    R, K, Hq, Hkv, D = 4, 12, 4, 2, 16
    q = jax.random.normal(ks[0], (R, Hq, D))
    k, v = jax.random.normal(ks[1], (R, K, Hkv, D)), jax.random.normal(ks[2], (R, K, Hkv, D))
    visible = jnp.ones((R, K), bool)
    full, _ = dense_attention_with_lse(q, k, v, visible, sm_scale=0.25)
    a = dense_attention_with_lse(q, k, v, visible.at[:, 5:].set(False), sm_scale=0.25)
    b = dense_attention_with_lse(q, k, v, visible.at[:, :5].set(False), sm_scale=0.25)
    tol = tolerance(dots="exact")  # dense_attention_with_lse pins HIGHEST
    np.testing.assert_allclose(merge_attention(*a, *b), full, rtol=tol.rtol, atol=tol.atol / 10)

"""Per-row sampling: the filtered distribution is right, greedy rows stay argmax, seeds reproduce."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.sampling import SamplingRows, sample_tokens, sampling_rows
from jspec.sampling_params import SamplingParams


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """The distribution a row must sample from, in float64 numpy."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    p = np.exp(x[order] - x[order].max())
    p /= p.sum()
    keep = np.ones_like(p, bool)
    if top_k > 0:
        keep[top_k:] = False
    keep &= (np.cumsum(p) - p) < top_p
    keep &= p >= min_p * p[0]
    keep[0] = True
    q = np.zeros_like(p)
    q[order[keep]] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 8, 0.9, 0.05)])
def test_sampled_distribution_matches_the_filtered_target(temperature, top_k, top_p, min_p):
    V, N = 24, 40000
    logits = np.random.default_rng(0).normal(size=V).astype(np.float32) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = sampling_rows([params] * N, np.arange(N, dtype=np.uint32), N)
    toks = np.asarray(jax.jit(sample_tokens)(jnp.broadcast_to(logits, (N, V)), rows, jnp.zeros(N, jnp.int32)))
    want = reference_probs(logits, temperature, top_k, top_p, min_p)
    got = np.bincount(toks, minlength=V) / N
    assert np.all(got[want == 0] == 0), "a filtered-out token was sampled"
    # Total variation of N samples from the right distribution stays below ~sqrt(V/N); 0.03 is
    # far beyond that (false alarm ~0), and far below what a wrong filter produces.
    assert 0.5 * np.abs(got - want).sum() < 0.03


def test_a_wrong_filter_is_caught():
    V, N = 24, 40000
    logits = np.random.default_rng(0).normal(size=V).astype(np.float32) * 2
    rows = sampling_rows([SamplingParams(temperature=1.0, top_p=0.8)] * N, np.arange(N, dtype=np.uint32), N)
    toks = np.asarray(jax.jit(sample_tokens)(jnp.broadcast_to(logits, (N, V)), rows, jnp.zeros(N, jnp.int32)))
    wrong = reference_probs(logits, 1.0, 0, 1.0, 0.0)  # forgot top_p
    assert 0.5 * np.abs(np.bincount(toks, minlength=V) / N - wrong).sum() > 0.03


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = np.random.default_rng(1).normal(size=(6, 50)).astype(np.float32)
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 0.0, 2.0, 0.0, 0.5)]
    toks = np.asarray(sample_tokens(jnp.asarray(logits), sampling_rows(params, list(range(6)), 6), jnp.arange(6)))
    for i in (0, 2, 4):
        assert toks[i] == logits[i].argmax()


def test_seed_and_position_fix_the_token_whatever_the_batch():
    logits = np.random.default_rng(2).normal(size=(1, 64)).astype(np.float32)
    p = SamplingParams(temperature=1.0)
    alone = sample_tokens(jnp.asarray(logits), sampling_rows([p], [123], 1), jnp.asarray([7]))
    others = np.random.default_rng(3).normal(size=(5, 64)).astype(np.float32)
    batch = np.concatenate([others[:3], logits, others[3:]])
    rows = sampling_rows([p] * 6, [9, 8, 7, 123, 6, 5], 6)
    mixed = sample_tokens(jnp.asarray(batch), rows, jnp.asarray([1, 2, 3, 7, 4, 5]))
    assert int(mixed[3]) == int(alone[0])


def test_seeded_request_reproduces_alongside_different_requests(tmp_path):
    from jspec.models.tiny import make_tiny_model

    model = jspec.load(make_tiny_model(str(tmp_path / "m"), seed=1))
    seeded = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    other = SamplingParams(max_new_tokens=6, temperature=0.8, ignore_eos=True)
    kw = dict(page_size=16, num_pages=128, attention_backend="reference")
    a = jspec.Engine(model, **kw).generate([[5, 6, 7]], seeded)[0].token_ids
    b = jspec.Engine(model, seed=9, **kw).generate([[1, 2], [5, 6, 7], [9] * 20], [other, seeded, other])[1].token_ids
    c = jspec.Engine(model, **kw).generate([[5, 6, 7]], dataclasses.replace(seeded, seed=43))[0].token_ids
    assert a == b and a != c


@pytest.mark.parametrize("kw,msg", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(seed=-1), "seed"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=[""]), "stop")])
def test_invalid_params_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)

"""Per-row sampling: the filtered distribution is right, greedy rows stay argmax, seeds reproduce."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.sampling import reference_keep, reference_probs

import jspec
from jspec.config.sampling import SamplingParams
from jspec.layers.sampling import TOP_K_CAP, keep_mask, sample_tokens, sampling_mode, sampling_rows


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 8, 0.9, 0.05)],
)
def test_sampled_distribution_matches_the_filtered_target(temperature, top_k, top_p, min_p):
    V, N = 24, 40000
    logits = np.random.default_rng(0).normal(size=V).astype(np.float32) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = sampling_rows([params] * N, np.arange(N, dtype=np.uint32), N)
    sample = jax.jit(sample_tokens, static_argnames="mode")
    toks = np.asarray(
        sample(jnp.broadcast_to(logits, (N, V)), rows, jnp.zeros(N, jnp.int32), mode=sampling_mode([params]))
    )
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
    from jspec.checkpoint.tiny import make_tiny_model

    model = jspec.load(make_tiny_model(str(tmp_path / "m"), seed=1, max_position_embeddings=512))
    seeded = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    other = SamplingParams(max_new_tokens=6, temperature=0.8, ignore_eos=True)
    kw = dict(page_size=16, max_total_tokens=2032, attention_backend="reference")
    a = jspec.Engine(model, **kw).generate([[5, 6, 7]], seeded)[0].token_ids
    b = (
        jspec.Engine(model, random_seed=9, **kw)
        .generate([[1, 2], [5, 6, 7], [9] * 20], [other, seeded, other])[1]
        .token_ids
    )
    c = jspec.Engine(model, **kw).generate([[5, 6, 7]], dataclasses.replace(seeded, seed=43))[0].token_ids
    assert a == b and a != c


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(seed=-1), "seed"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_params_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


FILTERS = [
    (5, 1.0, 0.0),
    (50, 0.9, 0.0),
    (0, 0.8, 0.0),
    (0, 1.0, 0.1),
    (8, 0.5, 0.05),
    (TOP_K_CAP, 0.99, 0.0),
    (0, 0.999, 0.0),
    (1, 1.0, 0.0),
    (300, 1.0, 0.0),
]


@pytest.mark.parametrize("V", [300, 5000])  # 5000 > TOP_K_CAP * 32: the group-maximum candidates
@pytest.mark.parametrize("top_k,top_p,min_p", FILTERS)
def test_keep_mask_equals_the_token_by_token_rule(V, top_k, top_p, min_p):
    rng = np.random.default_rng(V + top_k)
    x = (rng.normal(size=(3, V)) * 3).astype(np.float32)
    x[1, : V // 2] = np.round(x[1, : V // 2])  # many equal logits: kept or dropped together
    params = np.tile(np.array([1.0, top_k, top_p, min_p, 0, 0, 1], np.float32), (3, 1))
    want = np.stack([reference_keep(r, top_k, top_p, min_p) for r in x])
    covered_by_candidates = 1 <= top_k <= TOP_K_CAP or (top_p >= 1 and top_k <= 0)
    methods = [("auto", 1), ("search", 1), ("search", 2), ("search", 8)]
    methods += [("candidates", 1)] if covered_by_candidates else []
    for method, bits in methods:
        got = np.asarray(keep_mask(jnp.asarray(x), jnp.asarray(params), method, bits))
        assert (got == want).all(), (method, bits, (got != want).sum())


def test_a_row_draws_the_same_token_whatever_its_batch_needs():
    # On the CPU "auto" picks the threshold method per batch: candidates for top-k rows alone,
    # the search once a top-p row joins, nothing for temperature alone. A row's draw must not
    # depend on which ran.
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(16, 700)).astype(np.float32) * 2)
    pos = jnp.arange(16)
    top_k = [SamplingParams(temperature=0.8, top_k=40) if i % 2 else SamplingParams(temperature=1.2) for i in range(16)]
    with_top_p = top_k[:15] + [SamplingParams(temperature=1.0, top_p=0.7)]
    plain = [SamplingParams(temperature=1.2)] * 16
    draw = lambda ps: np.asarray(sample_tokens(logits, sampling_rows(ps, list(range(16)), 16), pos))  # noqa: E731
    a, b, c = draw(top_k), draw(with_top_p), draw(plain)
    np.testing.assert_array_equal(a[:15], b[:15])
    np.testing.assert_array_equal(a[::2], c[::2])
    assert sampling_mode(top_k) == sampling_mode(with_top_p) == "sampled"
    assert sampling_mode([SamplingParams(), SamplingParams(temperature=0.0, top_p=0.5)]) == "greedy"

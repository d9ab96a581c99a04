"""Logprobs of emitted tokens and top-n alternatives: right values, same with and without speculation."""

import numpy as np
import pytest

import jspec
from jspec.models.llama import dense_forward
from jspec.models.tiny import make_tiny_model
from jspec.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return jspec.load(make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), seed=6))


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logprobs_match_a_dense_recompute_and_spec_matches_plain(tiny):
    from test_engine import eagle_draft

    prompts = [[5, 9, 2, 7], list(range(30, 55))]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, return_logprob=True, top_logprobs_num=4)
    kw = dict(page_size=16, num_pages=128, max_top_logprobs=5, attention_backend="reference")
    plain = jspec.Engine(tiny, **kw).generate(prompts, params)
    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=5)
    spec_out = jspec.Engine(tiny, spec=spec, draft=eagle_draft(tiny), **kw).generate(prompts, params)
    for prompt, o, s in zip(prompts, plain, spec_out):
        assert len(o.logprobs) == len(o.token_ids) == len(o.top_logprobs)
        logits = np.asarray(dense_forward(tiny.params, tiny.cfg, np.asarray(prompt + o.token_ids, np.int32)))
        for j, (tok, lp, top) in enumerate(zip(o.token_ids, o.logprobs, o.top_logprobs)):
            ref = log_softmax(logits[len(prompt) - 1 + j])
            assert abs(lp - ref[tok]) < 1e-4
            assert [t for t, _ in top] == list(np.argsort(-ref, kind="stable")[:4])
            assert all(a >= b for (_, a), (_, b) in zip(top, top[1:]))
            assert top[0][0] == tok  # greedy: the emitted token is the top one
        assert s.token_ids == o.token_ids
        np.testing.assert_allclose(s.logprobs, o.logprobs, atol=1e-4)
        assert [[t for t, _ in row] for row in s.top_logprobs] == [[t for t, _ in row] for row in o.top_logprobs]


def test_sampled_logprobs_use_the_temperature(tiny):
    params = SamplingParams(max_new_tokens=6, temperature=0.5, seed=3, ignore_eos=True, return_logprob=True)
    o = jspec.Engine(tiny, page_size=16, num_pages=64, attention_backend="reference").generate([[1, 2, 3]], params)[0]
    logits = np.asarray(dense_forward(tiny.params, tiny.cfg, np.asarray([1, 2, 3] + o.token_ids, np.int32)))
    for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
        assert abs(lp - log_softmax(logits[2 + j] / 0.5)[tok]) < 1e-4


def test_more_top_logprobs_than_the_engine_serves_is_refused(tiny):
    engine = jspec.Engine(tiny, page_size=16, num_pages=64, max_top_logprobs=2, attention_backend="reference")
    with pytest.raises(ValueError, match="exceeds this engine's max_top_logprobs=2"):
        engine.add_request([1, 2], SamplingParams(return_logprob=True, top_logprobs_num=3))
    with pytest.raises(ValueError, match="top_logprobs_num"):
        SamplingParams(top_logprobs_num=-1)

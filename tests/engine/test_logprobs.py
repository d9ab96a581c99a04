"""Logprobs of emitted tokens and top-n alternatives: right values, same with and without speculation."""

import dataclasses

import numpy as np
import pytest
from support.models import tiny_model

import jspec
from jspec.config.sampling import SamplingParams
from jspec.models.llama import dense_forward

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny", seed=6, max_position_embeddings=512)


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logprobs_match_a_dense_recompute_and_spec_matches_plain(tiny):
    from support.models import eagle_draft

    prompts = [[5, 9, 2, 7], list(range(30, 55))]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, return_logprob=True, top_logprobs_num=4)
    kw = dict(
        page_size=16,
        max_total_tokens=2032,
        max_top_logprobs=5,
        precompile_bs_paddings=[2],  # one decode program however the rows finish
        attention_backend="reference",
    )
    plain = jspec.Engine(tiny, **kw).generate(prompts, params)
    spec = jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=5)
    spec_out = jspec.Engine(tiny, speculative=spec, draft=eagle_draft(tiny), **kw).generate(prompts, params)
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
    o = jspec.Engine(tiny, page_size=16, max_total_tokens=1008, attention_backend="reference").generate(
        [[1, 2, 3]], params
    )[0]
    logits = np.asarray(dense_forward(tiny.params, tiny.cfg, np.asarray([1, 2, 3] + o.token_ids, np.int32)))
    for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
        assert abs(lp - log_softmax(logits[2 + j] / 0.5)[tok]) < 1e-4


def test_more_top_logprobs_than_the_engine_serves_is_refused(tiny):
    engine = jspec.Engine(tiny, page_size=16, max_total_tokens=1008, max_top_logprobs=2, attention_backend="reference")
    with pytest.raises(ValueError, match="exceeds this engine's max_top_logprobs=2"):
        engine.add_request([1, 2], SamplingParams(return_logprob=True, top_logprobs_num=3))
    with pytest.raises(ValueError, match="top_logprobs_num"):
        SamplingParams(top_logprobs_num=-1)


@pytest.mark.parametrize("speculative", [False, True])
def test_prompt_logprobs_match_a_dense_recompute_across_chunks(tiny, speculative):
    from support.models import eagle_draft

    prompt = list(range(3, 40))
    params = SamplingParams(
        max_new_tokens=3, ignore_eos=True, return_logprob=True, logprob_start_len=0, top_logprobs_num=2
    )
    spec = jspec.SpecConfig("EAGLE3", num_steps=2, eagle_topk=1) if speculative else None
    engine = jspec.Engine(
        tiny,
        speculative=spec,
        draft=eagle_draft(tiny) if speculative else None,
        page_size=4,
        max_total_tokens=252,
        max_top_logprobs=2,
        chunked_prefill_size=16,
        attention_backend="reference",
    )
    warm = engine.generate([prompt[:20]], SamplingParams(max_new_tokens=2))  # fills the prefix cache
    o = engine.generate([prompt], params)[0]
    logits = np.asarray(dense_forward(tiny.params, tiny.cfg, np.asarray(prompt, np.int32)))
    assert len(o.input_logprobs) == len(prompt) and o.input_logprobs[0] is None
    for p in range(1, len(prompt)):  # three chunks of 16 tokens; the cached prefix was not used
        ref = log_softmax(logits[p - 1])
        assert abs(o.input_logprobs[p] - ref[prompt[p]]) < 1e-4, p
        assert [t for t, _ in o.input_top_logprobs[p]] == list(np.argsort(-ref, kind="stable")[:2])
    later = engine.generate([prompt], dataclasses.replace(params, logprob_start_len=30))[0]
    np.testing.assert_allclose(later.input_logprobs, o.input_logprobs[30:], atol=1e-5)
    assert engine.generate([prompt], dataclasses.replace(params, logprob_start_len=-1))[0].input_logprobs is None
    assert warm[0].input_logprobs is None
    engine.check_idle_no_leaks()


def test_n_completions_use_consecutive_seeds(tiny):
    engine = jspec.Engine(tiny, page_size=16, max_total_tokens=1008, attention_backend="reference")
    p = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
    outs = engine.generate([[1, 2, 3], [4, 5]], p)
    assert len(outs) == 6 and [o.prompt_token_ids for o in outs] == [[1, 2, 3]] * 3 + [[4, 5]] * 3
    singles = [engine.generate([[1, 2, 3]], dataclasses.replace(p, n=1, seed=11 + k))[0] for k in range(3)]
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in singles]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1
    with pytest.raises(ValueError, match="n=2"):
        engine.add_request([1, 2], SamplingParams(n=2))
    with pytest.raises(ValueError, match="logprob_start_len"):
        SamplingParams(logprob_start_len=-2)

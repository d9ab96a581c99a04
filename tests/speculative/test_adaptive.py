"""Adaptive speculation switches draft shapes losslessly: with the shape forced to change every
iteration (chains, trees, the (1,1,2) path and off), every method's greedy output equals plain
greedy decoding and its seeded sampled output equals plain seeded sampling, token for token;
and the policy, left to itself, measures its costs and reports what it chose."""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import pytest
from support.models import TARGET, draft_config, engine_settings, permutation_models, prompts

import jspec
from jspec.checkpoint.eagle import init_random_draft_params
from jspec.checkpoint.loader import init_random_params
from jspec.config.sampling import SamplingParams
from jspec.config.spec import SpecConfig
from jspec.speculative.adaptive import Choice, CostTable
from jspec.worker.programs import abstract_args, decode_jobs

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

# The engine's own shape first (a chain), then a tree, the no-draft-forward (1,1,2) and off.
SHAPES = "2,2,4 1,1,2 0,1,1"
# Every iteration a different shape, off twice in a row (the carry must survive it); in the
# synchronous runs also rows that verify their root alone while the other drafts (the ragged
# verify), in both row orders.
CYCLE = [Choice(i) for i in (0, 1, 2, 3, 3, 1, 0, 2, 3, 0)]
CYCLE_OPT_OUT = [Choice(0), Choice(1, [False, True]), Choice(3), Choice(3), Choice(0, [True, False]), Choice(2)]


def _models(method):
    if method in ("EAGLE", "EAGLE3"):
        target, dcfg, draft = permutation_models(method)  # drafts always right: long accepts
        return target, (dcfg, draft)
    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    if method == "STANDALONE":
        import dataclasses

        dcfg = dataclasses.replace(TARGET, num_layers=2, intermediate_size=32)
        return target, (dcfg, init_random_params(dcfg, jax.random.key(9), jnp.float32))
    return target, None


# One greedy and one seeded sampled request in one batch (one row bucket: few programs).
PROMPTS = prompts([3, 17])
PARAMS = [
    SamplingParams(max_new_tokens=12, ignore_eos=True),
    SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3),
]
_plain_outputs = {}


def _plain(target_name, target, kw):
    key = (target_name, kw["page_size"], kw["disable_overlap_schedule"])
    if key not in _plain_outputs:
        _plain_outputs[key] = [o.token_ids for o in jspec.Engine((TARGET, target), **kw).generate(PROMPTS, PARAMS)]
    return _plain_outputs[key]


def _fit(choice: Choice, rows: int) -> Choice:
    """choice for a batch of `rows` (the last iterations have fewer rows)."""
    if choice.drafting is None or len(choice.drafting) == rows:
        return choice
    return Choice(choice.shape)


# Every method, both page sizes, overlap on and off, and the opted-out rows of the synchronous
# runs: each of them in some case (EAGLE and EAGLE-3 share the carry and its switches, so each
# takes one side; the suite's time does not afford all eight).
@pytest.mark.parametrize(
    "method,page_size,overlap",
    [("EAGLE3", 1, False), ("EAGLE", 16, True), ("STANDALONE", 1, False), ("NGRAM", 16, True)],
)
def test_forced_switches_equal_plain_decoding(method, page_size, overlap):
    target, draft = _models(method)
    kw = engine_settings(page_size, overlap)
    base = _plain("permutation" if method.startswith("EAGLE") else "random", target, kw)
    steps = 4 if method == "NGRAM" else 3
    spec = SpecConfig(method, num_steps=steps, num_draft_tokens=steps + 1, adaptive=True, adaptive_shapes=SHAPES)
    engine = jspec.Engine((TARGET, target), speculative=spec, draft=draft, **kw)
    assert [m.spec.shape for m in engine.worker.methods][1:] == [(2, 2, 4) if method != "NGRAM" else (1, 2, 3)] + [
        (1, 1, 2),
        (0, 1, 1),
    ]
    cycle = itertools.cycle(CYCLE if overlap else CYCLE_OPT_OUT)
    engine.adaptive.costs = CostTable({}, "unused: the shapes are forced")
    engine.adaptive.choose = lambda alphas, bucket, ready=None: _fit(next(cycle), len(alphas))
    out = engine.generate(PROMPTS, PARAMS)
    engine.check_idle_no_leaks()
    assert [o.token_ids for o in out] == base
    if method in ("EAGLE", "EAGLE3"):  # the drafts were used across the switches, not just tolerated
        assert max(o.mean_accept_length for o in out) > 1.5


def _one_row_adaptive_engine(target, draft):
    """An adaptive EAGLE-3 engine choosing between (3,1,4) and off, one row: few programs."""
    return jspec.Engine(
        (TARGET, target),
        speculative=SpecConfig("EAGLE3", num_steps=3, adaptive=True, adaptive_shapes="0,1,1"),
        draft=draft,
        page_size=16,
        max_total_tokens=1024,
        max_running_requests=1,
        chunked_prefill_size=16,
        attention_backend="reference",
    )


def test_policy_measures_costs_and_reports_its_choices():
    engine = _one_row_adaptive_engine(*_models("EAGLE3"))
    engine.warmup(["greedy"])
    costs = engine.adaptive.costs
    assert costs.source.startswith("measured at warm-up")
    assert set(costs.seconds) == {(3, 1, 4), (0, 1, 1)} and all(set(r) == {1} for r in costs.seconds.values())
    assert all(t > 0 for r in costs.seconds.values() for t in r.values())
    # The CPU's own costs are noise at this size: fix them so that a 4-token verify costs two
    # plain steps. Speculation then pays at the prior estimate, and the perfect drafts keep it on.
    engine.adaptive.costs = CostTable({(3, 1, 4): {1: 2.0}, (0, 1, 1): {1: 1.0}}, "test")
    out = engine.generate(prompts([5]), SamplingParams(max_new_tokens=24, ignore_eos=True))
    info = engine.adaptive.describe()
    # Every iteration drafted (one more than the request counts: the overlap loop's lagging step).
    assert list(info["chosen_per_bucket"]) == [1] and list(info["chosen_per_bucket"][1]) == ["3,1,4"]
    assert info["chosen_per_bucket"][1]["3,1,4"] in (out[0].spec_verify_ct, out[0].spec_verify_ct + 1)
    assert info["mean_accept_per_shape"]["3,1,4"] > 2.5 and out[0].mean_accept_length > 3.0
    assert set(info["seconds_per_shape"]) == {"3,1,4"}


def test_adaptive_refuses_dp_attention_and_pd():
    from jspec.disaggregation.prefill import PrefillEngine

    target, draft = _models("EAGLE3")
    with pytest.raises(ValueError, match="adaptive speculation .* PD disaggregation"):
        PrefillEngine((TARGET, target), speculative=SpecConfig("EAGLE3", adaptive=True), draft=draft)
    with pytest.raises(ValueError, match="adaptive speculation"):
        jspec.Engine(
            (TARGET, target),
            speculative=SpecConfig("EAGLE3", adaptive=True),
            draft=draft,
            enable_dp_attention=True,
            dp_size=2,
            tp_size=2,
            max_total_tokens=512,
            attention_backend="reference",
        )


def test_replayed_ngram_traces_match_the_engine():
    """The replay benchmark computes NGRAM's accepts from a plain greedy record instead of running
    each shape: its iterations per request must be the engine's own, shape by shape."""
    from benchmarks.bench_adaptive import fixed, record, replay

    target = init_random_params(TARGET, jax.random.key(1), jnp.float32)
    ps = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5, 6, 7], [9, 30, 41]]
    spec = SpecConfig("NGRAM", adaptive=True, adaptive_shapes="3,2,7")
    shapes = spec.shapes()
    kw = dict(page_size=4, max_total_tokens=512, max_running_requests=4, attention_backend="reference")
    traces = record((TARGET, target), ps, ["a", "b", "c"], 16, shapes, spec)
    flat = CostTable({s: {1: 1.0} for s in shapes}, "unit")
    engine = jspec.Engine((TARGET, target), speculative=spec, **kw)
    engine.adaptive.costs = flat
    for i, shape in enumerate(shapes):
        engine.adaptive.choose = lambda alphas, bucket, ready=None, i=i: Choice(i)  # this shape only
        outs = engine.generate(ps, SamplingParams(max_new_tokens=16))
        for t, o in zip(traces, outs):
            assert len(o.token_ids) == t.generated
            assert sum(replay([t], flat, shapes, fixed(i))["iterations"].values()) == o.spec_verify_ct, (shape, t.name)


def test_the_off_shape_never_runs_the_drafts_lm_head():
    """Off verifies the root alone and keeps the draft's KV current, but needs no draft tokens:
    the draft's LM head (a vocabulary of its own here, so its product is told apart) is in the
    drafting shape's decode program and not in off's."""
    vocab = 40
    dcfg = draft_config("EAGLE3", vocab=vocab)
    draft = (dcfg, init_random_draft_params(dcfg, jax.random.key(2), std=0.2))
    w = _one_row_adaptive_engine(init_random_params(TARGET, jax.random.key(1), jnp.float32), draft).worker

    def draft_head_products(shape) -> int:
        index = next(i for i, m in enumerate(w.methods) if m.spec.shape == shape)
        (job,) = decode_jobs(w, ["greedy"], shapes=[index])
        jaxpr = jax.make_jaxpr(functools.partial(job.program.step, **job.program.static))(*abstract_args(job.args))
        return len(re.findall(rf",{vocab}\] = dot_general", str(jaxpr)))

    assert draft_head_products((3, 1, 4)) >= 1
    assert draft_head_products((0, 1, 1)) == 0

"""The adaptive-speculation policy on the host: its acceptance model, its choices and its
cost table; the draft-shape settings it reads."""

import dataclasses
import json

import numpy as np
import pytest

from jspec.config.spec import SpecConfig
from jspec.speculative.adaptive import AdaptivePolicy, Choice, CostTable, alpha_from_accept, expected_accepts

SHAPES = ((3, 1, 4), (5, 4, 8), (1, 1, 2), (0, 1, 1))


@dataclasses.dataclass
class Req:
    accept_alpha: float | None = None


def costs():
    table = {(3, 1, 4): 2.0, (5, 4, 8): 3.0, (1, 1, 2): 1.4, (0, 1, 1): 1.0}
    return CostTable({s: {1: t, 4: t * 1.5, 16: t * 2} for s, t in table.items()}, "test")


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_alpha_from_accept_inverts_expected_accepts(shape):
    alphas = np.array([0.05, 0.3, 0.6, 0.9])
    back = alpha_from_accept(expected_accepts(alphas, shape), shape)
    np.testing.assert_allclose(back, alphas, atol=1e-6)
    assert np.all(expected_accepts(alphas, (0, 1, 1)) == 0)


def test_expected_accepts_grow_with_depth_and_width():
    a = np.array([0.5])
    assert expected_accepts(a, (1, 1, 2)) < expected_accepts(a, (3, 1, 4)) < expected_accepts(a, (3, 2, 7))
    assert expected_accepts(a, (3, 1, 4))[0] == pytest.approx(0.5 + 0.25 + 0.125)


def test_choice_follows_acceptance_and_cost():
    policy = AdaptivePolicy(SHAPES, costs())
    assert policy.choose(np.full(4, 0.95), 4) == Choice(1)  # drafts nearly always right: the widest tree
    assert policy.choose(np.full(4, 0.02), 4) == Choice(3)  # drafts never right: off
    # Speculation that costs nothing extra pays even at modest acceptance.
    cheap = AdaptivePolicy(SHAPES, costs())
    cheap.costs.seconds[(3, 1, 4)] = {4: 1.0}
    assert cheap.choose(np.full(4, 0.3), 4) == Choice(0)
    # A program that is not ready is never picked.
    assert policy.choose(np.full(4, 0.95), 4, ready=lambda i, d: i != 1) == Choice(0)
    counts = policy.describe()["chosen_per_bucket"][4]
    assert counts == {"5,4,8": 1, "off": 1, "3,1,4": 1}


def test_rows_unlikely_to_accept_verify_their_root_alone():
    table = costs()
    alphas = np.array([0.02, 0.97, 0.01, 0.96])
    # No measured cost for a batch where only some rows draft: the batch drafts whole or not at all.
    assert AdaptivePolicy(SHAPES, table).choose(alphas, 4).drafting is None
    table.ragged[((5, 4, 8), 4, 2)] = 2.6  # (5,4,8) with 2 of 4 rows drafting: cheaper than all 4 (4.5)
    policy = AdaptivePolicy(SHAPES, table)
    # The two rows whose drafts are right draft; the two that never accept verify their root alone.
    choice = policy.choose(alphas, 4)
    assert policy.shapes[choice.shape] == (5, 4, 8) and choice.drafting == [False, True, False, True]
    assert policy.describe()["rows_opted_out"] == 2
    # Without the ragged program ready, or with opt-out turned off, the batch drafts whole.
    assert policy.choose(alphas, 4, ready=lambda i, d: d is None).drafting is None
    assert AdaptivePolicy(SHAPES, table, opt_out=False).choose(alphas, 4).drafting is None


def test_rows_left_out_are_probed_again():
    table = costs()
    table.ragged[((5, 4, 8), 4, 2)] = 2.6
    policy = AdaptivePolicy(SHAPES, table, probe_every=3)
    alphas = np.array([0.02, 0.97, 0.01, 0.96])
    picks = [policy.choose(alphas, 4) for _ in range(4)]
    assert [p.drafting is None for p in picks] == [False, False, True, False]
    assert SHAPES[picks[2].shape] == (1, 1, 2)  # every row drafts, with the cheapest drafting shape


def test_off_probes_the_cheapest_drafting_shape_now_and_then():
    policy = AdaptivePolicy(SHAPES, costs(), probe_every=4)
    picks = [SHAPES[policy.choose(np.full(2, 0.0), 1).shape] for _ in range(9)]
    assert picks == [(0, 1, 1)] * 3 + [(1, 1, 2)] + [(0, 1, 1)] * 3 + [(1, 1, 2), (0, 1, 1)]


def test_observations_move_each_requests_estimate():
    policy = AdaptivePolicy(SHAPES, costs(), decay=0.5)
    good, bad = Req(), Req()
    policy.observe(0, [good, bad], np.array([3, 0]), 0.01)  # a full accept is capped below the maximum
    assert 0.8 < good.accept_alpha < 1.0 and bad.accept_alpha == pytest.approx(0.0, abs=1e-6)
    first = good.accept_alpha
    policy.observe(0, [good, bad], np.array([0, 0]), 0.01)
    assert good.accept_alpha == pytest.approx(first / 2, rel=1e-6)
    np.testing.assert_allclose(policy.alphas([Req(), good]), [policy.prior_alpha, first / 2])
    policy.observe(3, [good], np.array([0]), 0.02)  # off tells nothing about acceptance
    assert good.accept_alpha == pytest.approx(first / 2, rel=1e-6)
    policy.observe(0, [good, bad], np.array([0, 3]), 0.0, drafting=[True, False])  # nor does a root-only row
    assert bad.accept_alpha == pytest.approx(0.0, abs=1e-6) and good.accept_alpha == pytest.approx(first / 4)
    info = policy.describe()
    assert info["seconds_per_shape"] == {"3,1,4": 0.02, "off": 0.02}
    assert info["mean_accept_per_shape"]["3,1,4"] == pytest.approx(0.375)  # means 1.5, 0, 0


def test_cost_table_reads_json_and_nearest_buckets(tmp_path):
    path = tmp_path / "c.json"
    data = {
        "costs": {"3,1,4": {"1": 0.002, "16": 0.004}, "off": {"1": 0.001}},
        "ragged": {"3,1,4": {"16": {"4": 3e-3}}},
    }
    path.write_text(json.dumps(data))
    table = CostTable.load(str(path))
    assert table.source == f"loaded from {path}"
    assert table.at((3, 1, 4), 1) == 0.002 and table.at((3, 1, 4), 8) == 0.004 and table.at((3, 1, 4), 64) == 0.004
    assert table.at((0, 1, 1), 16) == 0.001 and table.at((5, 4, 8), 1) is None
    assert table.ragged == {((3, 1, 4), 16, 4): 3e-3}
    assert CostTable.load(str(path)).to_json() == json.loads(path.read_text())


def test_spec_config_shapes():
    spec = SpecConfig("EAGLE3", num_steps=3, adaptive=True, adaptive_shapes="5,4,8 3,1,4 0,1,1")
    assert spec.shapes() == ((3, 1, 4), (5, 4, 8), (0, 1, 1))
    assert SpecConfig("EAGLE3", num_steps=3).shapes() == ((3, 1, 4),)
    ngram = SpecConfig("NGRAM", adaptive=True, adaptive_shapes="3,2,7 0,1,1")
    assert ngram.shapes() == ((7, 1, 8), (3, 2, 7), (0, 1, 1))
    with pytest.raises(ValueError, match="steps,topk,draft_tokens"):
        SpecConfig("EAGLE", adaptive=True, adaptive_shapes="3,1")
    with pytest.raises(ValueError, match="root-only"):
        SpecConfig("EAGLE", num_steps=0, eagle_topk=2, num_draft_tokens=1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecConfig("EAGLE", adaptive=True, adaptive_shapes="2,2,40")

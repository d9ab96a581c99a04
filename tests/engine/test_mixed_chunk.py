"""Mixed prefill + decode steps: a prefill carries the running requests' decode rows (their
tokens read from the device carry), and every request gets the tokens it gets when prefills run
alone: greedy, seeded sampling with penalties, logprobs, overlap on and off."""

import dataclasses

import numpy as np
import pytest
from support.models import tiny_model

import jspec
from jspec.worker.programs import Buckets, StepCosts

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny", seed=11, context=256)


SETTINGS = dict(
    page_size=4,
    max_total_tokens=4096,
    max_running_requests=8,
    chunked_prefill_size=32,  # prompts longer than the step's budget are chunked beside decode rows
    precompile_bs_paddings=[8],
    attention_backend="reference",
)


def arrivals(n=14, seed=0):
    """(step, prompt, params): requests arriving while others decode, greedy and sampled."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        params = jspec.SamplingParams(
            max_new_tokens=int(rng.integers(4, 20)),
            ignore_eos=True,
            temperature=0.0 if i % 2 else 0.9,
            seed=i,
            repetition_penalty=1.3 if i % 3 == 0 else 1.0,
            presence_penalty=0.5 if i % 4 == 1 else 0.0,
            frequency_penalty=0.7 if i % 4 == 2 else 0.0,
            return_logprob=i % 5 == 0,
            top_logprobs_num=2 if i % 5 == 0 else 0,
        )
        prompt = list(map(int, rng.integers(0, 200, int(rng.choice([1, 3, 9, 40, 70])))))
        out.append((2 * i, prompt, params))
    return out


def run(engine, reqs):
    pending, got, step = list(enumerate(reqs)), {}, 0
    while pending or engine.has_work():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, dataclasses.replace(params), rid=f"r{i}")
        for o in engine.step():
            ids, lps = got.setdefault(o.rid, ([], []))
            ids += o.new_token_ids
            lps += o.new_logprobs or []
        step += 1
        assert step < 3000
    engine.check_idle_no_leaks()
    return got


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_steps_give_the_tokens_of_prefills_alone(tiny, overlap):
    reqs = arrivals()
    kw = dict(SETTINGS, disable_overlap_schedule=not overlap)
    alone = jspec.Engine(tiny, disable_mixed_chunk=True, **kw)
    mixed = jspec.Engine(tiny, **kw)
    ref, got = run(alone, reqs), run(mixed, reqs)
    assert alone.loop_times.mixed_steps == 0
    assert mixed.loop_times.mixed_steps >= 5, mixed.loop_times
    same_tokens(got, ref, len(reqs))
    # The decode rows ride along: fewer launches than prefills and decodes taken one at a time.
    assert mixed.num_steps < alone.num_steps
    # Each token after a request's first is one gap in the loop's histogram, binned under the
    # kind of step that gave it: only decode steps without mixing, some mixed steps with it.
    for engine, outs in ((alone, ref), (mixed, got)):
        gaps = engine.loop_times.token_gaps
        assert sum(map(sum, gaps.values())) == sum(len(ids) - 1 for ids, _ in outs.values())
    assert sum(alone.loop_times.token_gaps["mixed"]) == 0 < sum(mixed.loop_times.token_gaps["mixed"])
    if overlap:
        # Mixed steps cut to a cost bound: the step costs timed at warm-up (this machine's: the
        # bound itself is checked below on fixed costs), then the same tokens.
        bounded = jspec.Engine(tiny, mixed_chunk_slowdown=1.5, **kw)
        # The bound picks among powers of two; without it (the CPU's default) powers of four.
        assert (bounded.worker.buckets.prefill_ratio, mixed.worker.buckets.prefill_ratio) == (2, 4)
        bounded.warmup(sampling_modes=("greedy", "sampled"))
        costs = bounded.scheduler.step_costs
        assert costs is not None and sorted(costs.prefill) == [16, 32] and sorted(costs.decode) == [8]
        assert all(t > 0 for t in [*costs.prefill.values(), *costs.decode.values()])
        same_tokens(run(bounded, reqs), ref, len(reqs))


def same_tokens(got, ref, n):
    assert got.keys() == ref.keys() and len(got) == n
    for rid in ref:
        assert got[rid][0] == ref[rid][0], rid
        np.testing.assert_allclose(got[rid][1], ref[rid][1], rtol=1e-4, atol=1e-5)


def test_a_mixed_step_is_cut_to_its_cost_bound(tiny):
    """With a prefill of 16 tokens costing 1.4x a decode of the rows and one of 32 costing 3x,
    a bound of 2 lets a step carrying one decode row take 15 prompt tokens, not 31; a bound of 3
    the whole chunk."""
    for slowdown, prompt_tokens in ((2.0, 15), (3.0, SETTINGS["chunked_prefill_size"] - 1)):
        engine = jspec.Engine(tiny, mixed_chunk_slowdown=slowdown, **SETTINGS)
        engine.scheduler.step_costs = StepCosts({16: 1.4, 32: 3.0}, {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2})
        engine.scheduler.mixed_slowdown = slowdown
        engine.add_request(list(range(5)), jspec.SamplingParams(max_new_tokens=30, ignore_eos=True))
        engine.step()  # its prefill: no decode rows, the whole chunk
        engine.add_request(list(range(100)), jspec.SamplingParams(max_new_tokens=2, ignore_eos=True))
        batch = engine.scheduler.schedule()
        assert [len(c.tokens) for c in batch.chunks] == [prompt_tokens, 1]


def test_step_costs_bound_the_mixed_step_tokens():
    # A bounded scheduler's worker pads prefills to powers of two, not four: finer choices.
    assert Buckets(512, 8, prefill_ratio=2).prefill_token_buckets() == [16, 32, 64, 128, 256, 512]
    assert Buckets(512, 8).prefill_token_buckets() == [16, 64, 256, 512]
    costs = StepCosts({16: 1.0, 32: 1.1, 64: 1.3, 128: 1.8, 256: 3.0, 512: 6.0}, {1: 1.0, 8: 1.1, 64: 1.6, 256: 3.5})
    assert costs.mixed_step_tokens(1, 2.0) == 128  # 1.8 <= 2 x 1.0; 256 would cost 3x
    assert costs.mixed_step_tokens(5, 2.0) == 128  # the rows pad to 8: 2 x 1.1
    assert costs.mixed_step_tokens(64, 2.0) == 256  # 3.0 <= 3.2
    assert costs.mixed_step_tokens(64, 1.5) == 128  # only 128 fits
    assert costs.mixed_step_tokens(200, 1.5) == 256  # the rows pad to 256: 3.0 <= 5.25 < 6.0
    assert costs.mixed_step_tokens(64, 1.0) == 128  # none fits: the smallest bucket past the rows
    assert costs.mixed_step_tokens(512, 2.0) == 0  # no bucket past the rows


def test_short_steps_are_timed_more_often_and_the_least_run_counts(monkeypatch):
    """measure_step_costs runs a short program until it has run STEP_COST_SECONDS (a dozen runs
    at most) and a long one its three, after one untimed run each, and keeps each one's least:
    a run slowed by the machine does not move the cost that decides a mixed step's budget. The
    timed runs take the programs in turn: every program's first before any one's second."""
    from jspec.worker import programs

    runs: dict[tuple[str, int], int] = {}
    order: list[tuple[str, int]] = []
    clock = [0.0]
    seconds = {("prefill", 16): 0.001, ("prefill", 64): 0.04, ("decode", 1): 0.001}

    def fake(kind):
        def run(worker, n):
            key = (kind, n)
            order.append(key)
            runs[key] = runs.get(key, 0) + 1
            # The second timed run of each program is slow, as if the machine stalled.
            clock[0] += seconds[key] * (10 if runs[key] == 3 else 1)

        return run

    class Worker:
        buckets = dataclasses.make_dataclass("B", [])()
        last_decode = "loop's batch"

    Worker.buckets.prefill_token_buckets = lambda: [16, 64]
    Worker.buckets.decode_buckets = lambda: [1]
    monkeypatch.setattr(programs, "scratch_prefill", fake("prefill"))
    monkeypatch.setattr(programs, "scratch_decode", fake("decode"))
    monkeypatch.setattr(programs.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(programs.jax, "block_until_ready", lambda x: x)
    worker = Worker()
    costs = programs.measure_step_costs(worker)
    least, most = programs.STEP_COST_RUNS
    assert runs == {("prefill", 16): 1 + most, ("prefill", 64): 1 + least, ("decode", 1): 1 + most}
    assert costs.prefill == pytest.approx({16: 0.001, 64: 0.04}) and costs.decode == pytest.approx({1: 0.001})
    assert worker.last_decode is None
    programs_ = list(seconds)
    assert order[: 2 * len(programs_)] == programs_ + programs_  # the untimed round, then the first timed one


def test_decode_rows_take_their_share_of_the_step_first(tiny):
    engine = jspec.Engine(tiny, **SETTINGS)
    engine.add_request(list(range(5)), jspec.SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.step()  # its prefill
    engine.add_request(list(range(100)), jspec.SamplingParams(max_new_tokens=2, ignore_eos=True))
    batch = engine.scheduler.schedule()
    assert batch.decode_rows == [False, True]
    assert [len(c.tokens) for c in batch.chunks] == [SETTINGS["chunked_prefill_size"] - 1, 1]
    running = engine.scheduler.running[0]
    assert batch.chunks[1].start == running.kv_len + running.inflight - 1  # its next position

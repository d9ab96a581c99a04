"""The engine's overlap loop against its synchronous reference, retraction, prefix cache,
and the rule that the loop reads the device only at its one designated point."""

import dataclasses

import numpy as np
import pytest
from support.models import eagle_draft, tiny_model
from support.sync_guard import count_device_reads

import jspec

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny", seed=3, context=512)  # the workloads stay under 512 tokens


@dataclasses.dataclass
class Arrival:
    step: int
    prompt: list[int]
    params: jspec.SamplingParams
    abort_after: int | None  # abort once this many tokens are out


def workload(n=34, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.choice([1, 2, 5, 17, 64, 130, 300])) if i % 3 else int(rng.integers(1, 300))
        stop = ["a", "\n"] if i % 5 == 0 else []
        params = jspec.SamplingParams(max_new_tokens=int(rng.integers(1, 24)), stop=stop, ignore_eos=i % 4 == 0)
        abort = int(rng.integers(1, 6)) if i % 7 == 3 else None
        out.append(Arrival(int(rng.integers(0, 40)), list(map(int, rng.integers(0, vocab, length))), params, abort))
    return sorted(out, key=lambda a: a.step)


def run_workload(engine, arrivals, guard=None):
    """Drives the engine step by step, adding requests at their step and aborting some mid-way."""
    pending = list(arrivals)
    rids, step = {}, 0
    while pending or engine.has_work():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            rids[engine.add_request(a.prompt, dataclasses.replace(a.params))] = a
        outs = engine.step() if guard is None else guard(engine.step)
        step += 1
        for o in outs:
            a = rids[o.rid]
            req = engine.scheduler.requests.get(o.rid)
            if a.abort_after is not None and req is not None and len(req.output) >= a.abort_after:
                engine.abort(o.rid)
        assert step < 5000
    return rids


def collect(engine, arrivals):
    results = {}
    orig_retire = engine.scheduler.retire

    def retire(req):
        results[req.rid] = (list(req.output), req.text, req.finish_reason)
        orig_retire(req)

    engine.scheduler.retire = retire
    run_workload(engine, arrivals)  # request ids follow arrival order, so both runs name them alike
    engine.check_idle_no_leaks()
    return results


# The page-16 engines of this file share their programs (one pool, slot count, chunk size and
# decode buckets): each is compiled once. 4 and 16 rows: the batch still changes bucket.
PAGE16 = dict(
    page_size=16,
    max_total_tokens=(4096 // 16 + 63) * 16,
    max_running_requests=16,
    chunked_prefill_size=256,
    precompile_bs_paddings=[4, 16],
    attention_backend="reference",
)


# Page 1 with speculation covers page 1; page 16 both ways covers the plain loop.
@pytest.mark.parametrize("page_size,speculative", [(16, False), (16, True), (1, True)])
def test_overlap_equals_sync_on_a_mixed_workload(tiny, page_size, speculative):
    arrivals = workload()
    kw = dict(
        PAGE16,
        page_size=page_size,
        max_total_tokens=(4096 // page_size + 63) * page_size,
    )
    if speculative:
        kw.update(
            speculative=jspec.SpecConfig("EAGLE3", num_steps=3, eagle_topk=2, num_draft_tokens=5),
            draft=eagle_draft(tiny),
        )
    sync = collect(jspec.Engine(tiny, disable_overlap_schedule=True, **kw), arrivals)
    overlap = collect(jspec.Engine(tiny, **kw), arrivals)
    assert sync.keys() == overlap.keys() and len(sync) == len(arrivals)
    reasons = set()
    for key in sync:
        (s_ids, s_text, s_reason), (o_ids, o_text, o_reason) = sync[key], overlap[key]
        reasons.add(s_reason)
        if s_reason == "abort" or o_reason == "abort":
            # Aborted at a step boundary that differs between the loops: one is a prefix of the other.
            short, long_ = sorted([s_ids, o_ids], key=len)
            assert long_[: len(short)] == short
        else:
            assert (s_ids, s_text, s_reason) == (o_ids, o_text, o_reason)
    assert {"length", "abort"} <= reasons


def test_loop_reads_the_device_only_at_the_designated_point(tiny):
    engine = jspec.Engine(tiny, **PAGE16)
    arrivals = workload(n=12, seed=1)
    # Warm up (compilation, first transfers) outside the guard, then the guarded run.
    run_workload(engine, workload(n=12, seed=1))
    engine.loop_times = type(engine.loop_times)()
    steps_before = engine.num_steps
    with count_device_reads() as reads:
        run_workload(engine, arrivals)
    assert reads.designated, "the loop must read step outputs somewhere"
    assert not reads.hidden, reads.report()
    engine.check_idle_no_leaks()
    # Every launched step was timed, and the phases are each accounted once (no overlap).
    times = engine.loop_times
    assert times.iterations >= engine.num_steps - steps_before > 0
    assert min(times.schedule_s, times.launch_s, times.wait_s, times.process_s) > 0
    per = times.per_iteration_ms()
    assert per["host"] == pytest.approx(per["schedule"] + per["launch"] + per["process"])


def test_loop_counts_running_and_waiting_requests_per_iteration(tiny):
    """Twenty requests at once against sixteen slots: the loop's occupancy counters see at most
    sixteen running in any iteration and the other four waiting until slots free up."""
    engine = jspec.Engine(tiny, **PAGE16)
    params = jspec.SamplingParams(max_new_tokens=6, ignore_eos=True)
    for i in range(20):
        engine.add_request([1 + i, 2, 3, 4, 5], params, rid=f"r{i}")
    while engine.has_work():
        engine.step()
    engine.check_idle_no_leaks()
    times = engine.loop_times
    assert times.waiting_sum >= 4  # the four over the limit waited one iteration at least
    assert 16 < times.running_sum <= 16 * times.iterations
    assert times.running_sum >= 20 * 5  # each request counted in every iteration that decoded one of its tokens


def test_retraction_finishes_everything_with_the_same_outputs(tiny):
    arrivals = [
        Arrival(0, list(range(10 + 7 * i, 40 + 7 * i)), jspec.SamplingParams(max_new_tokens=40, ignore_eos=True), None)
        for i in range(6)
    ]
    kw = dict(
        page_size=4,
        max_running_requests=8,
        precompile_bs_paddings=[8],  # one decode program per pool (test_penalties.py runs the same)
        attention_backend="reference",
        disable_radix_cache=True,
    )
    big = jspec.Engine(tiny, max_total_tokens=1020, **kw)
    ref = collect(big, arrivals)
    small = jspec.Engine(tiny, max_total_tokens=156, **kw)  # 6 requests x 70 tokens need 108 pages at once
    got = collect(small, arrivals)
    assert small.scheduler.num_retractions > 0
    assert got == ref


def test_prefix_cache_prefills_only_new_tokens(tiny):
    rng = np.random.default_rng(5)
    prefix = list(map(int, rng.integers(0, 256, 200)))
    a, b = prefix + [1, 2, 3], prefix + [7, 8, 9, 10, 11]
    params = jspec.SamplingParams(max_new_tokens=8, ignore_eos=True)
    cold = jspec.Engine(tiny, **PAGE16, disable_radix_cache=True)
    expect = cold.generate([a, b], params)
    engine = jspec.Engine(tiny, **PAGE16)
    first = engine.generate([a], params)
    before = engine.scheduler.prefilled_tokens
    second = engine.generate([b], params)
    prefilled = engine.scheduler.prefilled_tokens - before
    assert prefilled == len(b) - 192  # 12 full pages of the shared prefix came from the cache
    assert [first[0].token_ids, second[0].token_ids] == [o.token_ids for o in expect]
    engine.check_idle_no_leaks()


def test_warmup_compiles_every_program_the_loop_runs(tiny):
    engine = jspec.Engine(tiny, **PAGE16)
    # The workload is greedy without prompt logprobs, so the greedy programs must cover it.
    n = engine.warmup(sampling_modes=("greedy",))
    w = engine.worker
    assert n == len(w.buckets.prefill_token_buckets()) + len(w.buckets.decode_buckets()) == len(w.programs.compiled)
    compiled = dict(w.programs.compiled)
    run_workload(engine, workload(n=10, seed=2))
    assert w.programs.compiled == compiled, "the loop compiled"
    engine.check_idle_no_leaks()


def test_warmup_refuses_an_unknown_sampling_mode(tiny):
    engine = jspec.Engine(
        tiny, page_size=16, max_total_tokens=1008, max_running_requests=2, attention_backend="reference"
    )
    with pytest.raises(ValueError, match="unknown sampling modes"):
        engine.warmup(sampling_modes=("greedy", "beam"))

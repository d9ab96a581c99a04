"""AsyncEngine: concurrent async streams equal plain generation; a client that leaves aborts."""

import asyncio
import time

import numpy as np
import pytest
from support.models import tiny_model

import jspec
from jspec.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.slow  # builds engines, servers or HF references


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory, "tiny", seed=4, max_position_embeddings=512)


def make_engine(tiny, **settings):
    return jspec.Engine(
        tiny, page_size=16, max_total_tokens=4080, max_running_requests=8, attention_backend="reference", **settings
    )


def read_all(engine, reader):
    """Runs the coroutine `reader` over engine's streams, then stops the engine."""
    try:
        return asyncio.run(reader)
    finally:
        engine.shutdown()


def assert_same_request(outs, expect, tokenizer):
    """A request's streamed outputs add up to what generate gave: tokens, text and logprobs."""
    assert sum((o.new_token_ids for o in outs), []) == expect.token_ids
    assert "".join(o.new_text for o in outs) == tokenizer.decode(expect.token_ids)
    assert sum((o.new_logprobs for o in outs), []) == pytest.approx(expect.logprobs)


def test_concurrent_streams_equal_generate_and_disconnects_free_kv(tiny):
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (3, 9, 20, 33, 5, 12)]
    params = jspec.SamplingParams(max_new_tokens=12, ignore_eos=True)
    expect = [o.token_ids for o in make_engine(tiny).generate(prompts, params)]
    engine = AsyncEngine(make_engine(tiny))

    async def consume(p):
        toks, text = [], ""
        async for out in engine.stream(p, jspec.SamplingParams(max_new_tokens=12, ignore_eos=True)):
            toks += out.new_token_ids
            text += out.new_text
        return toks, text

    async def leave_early(p):
        async for out in engine.stream(p, jspec.SamplingParams(max_new_tokens=200, ignore_eos=True)):
            if out.new_token_ids:
                break  # the client disconnects

    async def bad():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async for _ in engine.stream([10**6]):
                pass

    async def main():
        results = await asyncio.gather(*(consume(p) for p in prompts), *(leave_early(p) for p in prompts[:3]), bad())
        return results[: len(prompts)]

    try:
        got = asyncio.run(main())
        assert [t for t, _ in got] == expect
        assert all(text == tiny.tokenizer.decode(t) for t, text in got)
        deadline = time.time() + 30
        while engine.engine.has_work() and time.time() < deadline:
            time.sleep(0.05)
    finally:
        engine.shutdown()
    engine.engine.check_idle_no_leaks()


def test_a_reader_that_falls_behind_gets_the_missed_steps_as_one_output(tiny):
    """Outputs queued while the reader was busy come out merged: the same tokens, text and
    logprobs in fewer outputs."""
    prompt = [5, 9, 33, 70]
    params = jspec.SamplingParams(max_new_tokens=16, ignore_eos=True, return_logprob=True)
    (expect,) = make_engine(tiny).generate([prompt], params)
    engine = AsyncEngine(make_engine(tiny))

    async def slow_reader():
        outs = []
        async for out in engine.stream(prompt, params):
            outs.append(out)
            while engine.engine.has_work():  # the engine runs ahead: several steps queue up
                await asyncio.sleep(0.01)
        return outs

    outs = read_all(engine, slow_reader())
    assert_same_request(outs, expect, tiny.tokenizer)
    assert len(outs) < len(expect.token_ids) and outs[-1].finished


def test_a_stream_interval_sends_the_same_tokens_in_fewer_chunks(tiny):
    """--stream-interval 4: the first output at once, then chunks of at least 4 tokens, the last
    one whatever is left; tokens, text and logprobs as generate gives them."""
    prompt = [7, 3, 50, 12]
    params = jspec.SamplingParams(max_new_tokens=15, ignore_eos=True, return_logprob=True)
    (expect,) = make_engine(tiny).generate([prompt], params)
    engine = AsyncEngine(make_engine(tiny, stream_interval=4))

    async def read():
        return [out async for out in engine.stream(prompt, params)]

    outs = read_all(engine, read())
    assert_same_request(outs, expect, tiny.tokenizer)
    sizes = [len(o.new_token_ids) for o in outs]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and outs[-1].finished and len(outs) <= 5, sizes


def test_the_stream_batcher_holds_outputs_until_the_interval_and_flushes_aborts():
    from jspec.engine.async_engine import StreamBatcher
    from jspec.engine.engine import RequestOutput

    def out(rid, n, finished=False, reason=None):
        return RequestOutput(rid, list(range(n)), "x" * n, finished, reason)

    b = StreamBatcher(3)
    assert [o.rid for o in b.outputs([out("a", 1), out("b", 1)])] == ["a", "b"]  # first outputs at once
    assert b.outputs([out("a", 1), out("b", 2)]) == []  # a holds 1 token, b 2
    (a,) = b.outputs([out("a", 2)])
    assert (a.rid, a.new_token_ids, a.new_text) == ("a", [0, 0, 1], "xxx")
    (b_abort,) = b.outputs([RequestOutput("b", [], "", True, "abort")])  # held tokens go with the abort
    assert (b_abort.new_text, b_abort.finished, b_abort.finish_reason) == ("xx", True, "abort")
    (a_last,) = b.outputs([out("a", 1, finished=True, reason="length")])  # the last at once
    assert (a_last.new_text, a_last.finish_reason, b.held, b.streaming) == ("x", "length", {}, set())
    b.outputs([out("e", 1)])
    (failed,) = b.outputs([RequestOutput("e", [], "", False, error="its prefill engine died")])
    assert failed.error and b.held == {}
    assert StreamBatcher(1).outputs([out("c", 1), out("c", 1)]) == [out("c", 1), out("c", 1)]

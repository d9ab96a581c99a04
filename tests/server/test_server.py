"""scripts/serve.py as a real server on 127.0.0.1, driven by the official `openai` client.

Texts equal jspec.generate's for the same greedy requests (with and without EAGLE-3);
32 concurrent streams all finish, 8 that hang up mid-stream leave no KV held, and clients
dropping under load leave no error in the server's log; every bad input gets its
OpenAI-shaped error and the next good request still succeeds; /metrics parses with
prometheus_client and moves; SIGTERM stops the server cleanly.
"""

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from support import REPO_ROOT
from support.server import Server, assert_idle_without_leaks, free_port, hang_up, streamed_text

import jspec
from jspec.checkpoint.tiny import make_tiny_model
from jspec.testing.eagle_tiny import make_tiny_draft

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

openai = pytest.importorskip("openai")
ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("srv") / "tiny"), seed=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
    yield s
    assert s.stop()


# jspec.generate with the Server's settings: its programs are the server's, so one of the two
# processes loads them from the other's compilation cache.
SERVER_ENGINE = dict(page_size=4, max_total_tokens=4096, max_running_requests=40, attention_backend="reference")


def reference(model_dir, prompts, max_new, spec=None):
    return jspec.generate(model_dir, prompts, max_new_tokens=max_new, speculative=spec, **SERVER_ENGINE)


def reference_with(model_dir, prompts, sampling_params):
    """reference() with full SamplingParams (logprobs among them)."""
    return jspec.generate(model_dir, prompts, sampling_params=sampling_params, **SERVER_ENGINE)


def chat_prompt_ids(model_dir, messages):
    from jspec.server.chat_template import render_chat

    tok = jspec.load(model_dir).tokenizer
    return tok.encode(render_chat(tok, messages), add_special_tokens=False)


def check_openai_matches_generate(srv, model_dir, spec=None):
    prompts = ["Hello there", "jspec"]
    ref = reference(model_dir, prompts, 12, spec)
    c = srv.client
    for p, r in zip(prompts, ref):
        got = c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
        assert got.choices[0].text == r.text
        assert got.usage.completion_tokens == len(r.token_ids)
        streamed = "".join(
            ch.choices[0].text
            for ch in c.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0, stream=True)
            if ch.choices
        )
        assert streamed == r.text
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi!"}]
    ref_chat = reference(model_dir, [chat_prompt_ids(model_dir, messages)], 10, spec)[0]
    got = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == ref_chat.text
    chunks = list(
        c.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref_chat.text
    assert chunks[-1].usage.completion_tokens == len(ref_chat.token_ids)


def test_openai_client_matches_generate(server, model_dir):
    check_openai_matches_generate(server, model_dir)


def test_openai_client_matches_generate_with_eagle(model_dir, tmp_path):
    cfg = jspec.load(model_dir).cfg
    draft = make_tiny_draft(str(tmp_path / "eagle3"), cfg, "EAGLE3", seed=4)
    spec_flags = [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "2",
        "--speculative-num-draft-tokens",
        "5",
    ]
    # Adaptive between this tree and off, from a cost table on disk: lossless, so the output
    # still equals the fixed tree's; the random head's low acceptance makes it switch.
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"costs": {"3,2,5": {"1": 0.0025, "64": 0.0025}, "off": {"1": 0.001, "64": 0.001}}}))
    adaptive = ["--speculative-adaptive", "--speculative-adaptive-shapes", "0,1,1"]
    srv = Server(model_dir, *spec_flags, *adaptive, "--speculative-adaptive-cost-table", str(costs))
    try:
        spec = jspec.SpecConfig("EAGLE3", draft, num_steps=3, eagle_topk=2, num_draft_tokens=5)
        check_openai_matches_generate(srv, model_dir, spec)
        r = srv.post_raw(
            "/generate",
            json.dumps({"text": "abc", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).encode(),
        )[1]
        assert r["meta_info"]["spec_verify_ct"] >= 1
        got = srv.client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0)
        assert got.usage.model_extra["spec_accept_length"] >= 1.0
        server_info = json.loads(srv.get("/get_server_info"))
        adaptive_info = server_info["speculative_adaptive"]
        assert adaptive_info["cost_source"] == f"loaded from {costs}"
        assert adaptive_info["shapes"] == ["3,2,5", "off"] and adaptive_info["chosen_per_bucket"]
        assert "jspec_spec_adaptive_iterations_total{" in srv.get("/metrics")
        info = server_info["speculative"]
        assert (info["algorithm"], info["num_steps"], info["eagle_topk"], info["num_draft_tokens"]) == (
            "EAGLE3",
            3,
            2,
            5,
        )
    finally:
        assert srv.stop()


def test_concurrent_streams_and_disconnects_leak_nothing(server, model_dir):
    prompts = [f"request {i}: " + "xy" * (i % 7) for i in range(32)]
    ref = {p: r.text for p, r in zip(prompts, reference(model_dir, prompts, 24))}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def full(p):
        return p, await streamed_text(client, p, 24)

    async def main():
        return await asyncio.gather(*[full(p) for p in prompts], *[hang_up(client, f"leaver {i}") for i in range(8)])

    results = asyncio.run(main())
    for p, text in results[:32]:
        assert text == ref[p], p
    assert_idle_without_leaks(server)


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(server, model_dir):
    cases = [
        (b'{"prompt": "hi", "max_tokens": 4', 400, "not valid JSON"),
        (b'{"prompt": "hi", "max_tokens": "four"}', 400, "max_tokens"),
        (json.dumps({"prompt": "x" * 5000, "max_tokens": 4}).encode(), 400, "context is 512 tokens"),
        (json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "hi", "top_p": 1.5}).encode(), 400, "top_p"),
        (json.dumps({"prompt": "hi", "model": "gpt-17"}).encode(), 404, "does not exist"),
        (json.dumps({"prompt": [1, 2, 99999]}).encode(), 400, "outside the vocabulary"),
        (json.dumps({"prompt": "hi", "logprobs": 50}).encode(), 400, "max-top-logprobs"),
    ]
    for body, status, words in cases:
        code, err = server.post_raw("/v1/completions", body)
        assert code == status, (body[:60], code, err)
        assert words in err["error"]["message"] and err["error"]["type"], err
        ok = server.client.completions.create(model="tiny", prompt="still here?", max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model="tiny", messages=[], max_tokens=3)


def test_unknown_roles_overlong_completions_and_stop_lists_get_400s(server):
    """A chat role OpenAI does not know, a completion length that does not fit in the context
    after the prompt (asked for explicitly: a default is clipped), and more stop strings than
    MAX_STOP_STRINGS or an empty one: each a 400, and the next good request still succeeds."""
    from jspec.server.protocol import MAX_STOP_STRINGS

    near_full = [1] * 508  # a 512-token context: room for 4 tokens
    chat = [{"role": "user", "content": "hi"}]
    many = [f"stop{i}" for i in range(MAX_STOP_STRINGS + 1)]
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]},
            "messages.1.role",
        ),
        (
            "/v1/completions",
            {"prompt": near_full, "max_tokens": 5},
            "maximum context length is 512 tokens. However, you requested 513 tokens (508 in the prompt, 5 in the",
        ),
        ("/v1/completions", {"prompt": [[1, 2, 3], near_full], "max_tokens": 100}, "508 in the prompt"),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 600}, "in the messages, 600 in the completion"),
        (
            "/v1/chat/completions",
            {"messages": chat, "max_completion_tokens": 512, "max_tokens": 4},
            "maximum context length is 512 tokens",
        ),
        ("/generate", {"input_ids": near_full, "sampling_params": {"max_new_tokens": 5}}, "you requested 513 tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": many}, f"at most {MAX_STOP_STRINGS} stop strings"),
        ("/v1/chat/completions", {"messages": chat, "stop": many}, f"at most {MAX_STOP_STRINGS} stop strings"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": many}}, f"at most {MAX_STOP_STRINGS} stop strings"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": {"a": 1}}}, "a string or a list of strings"),
        ("/v1/completions", {"prompt": "hi", "stop": ""}, "non-empty strings"),
        ("/v1/chat/completions", {"messages": chat, "stop": ["x", ""]}, "non-empty strings"),
        ("/generate", {"text": "hi", "sampling_params": {"stop": [""]}}, "non-empty strings"),
    ]
    for path, body, words in cases:
        code, err = server.post_raw(path, json.dumps({"model": "tiny", **body}).encode())
        assert code == 400, (path, body, code, err)
        assert words in err["error"]["message"] and err["error"]["type"] == "invalid_request_error", err
        ok = server.client.completions.create(model="tiny", prompt="still here?", max_tokens=3, temperature=0)
        assert ok.choices[0].finish_reason == "length"

    # What fits still runs: the room exactly, a length left to its default (clipped to the room),
    # the other roles, and MAX_STOP_STRINGS stop strings.
    ok = server.client.completions.create(
        model="tiny", prompt=near_full, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 4
    ok = server.client.completions.create(
        model="tiny", prompt=near_full, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ok.usage.completion_tokens == 4 and ok.choices[0].finish_reason == "length"
    code, r = server.post_raw(
        "/generate",
        json.dumps(
            {
                "input_ids": near_full,
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "stop": many[:MAX_STOP_STRINGS]},
            }
        ).encode(),
    )
    assert code == 200 and r["meta_info"]["completion_tokens"] == 4
    roles = [{"role": r, "content": "hi"} for r in ("developer", "system", "user", "assistant", "tool", "user")]
    ok = server.client.chat.completions.create(
        model="tiny", messages=roles, max_completion_tokens=3, stop=many[:MAX_STOP_STRINGS], temperature=0
    )
    assert ok.choices[0].message.content is not None


def test_metrics_parse_and_move(server):
    from prometheus_client.parser import text_string_to_metric_families

    def sample(name):
        for fam in text_string_to_metric_families(server.get("/metrics")):
            for s in fam.samples:
                if s.name == name:
                    return s.value
        raise KeyError(name)

    before = sample("jspec_generation_tokens_total"), sample("jspec_time_to_first_token_seconds_count")
    server.client.completions.create(model="tiny", prompt="count me", max_tokens=5, temperature=0, logprobs=2)
    after = sample("jspec_generation_tokens_total"), sample("jspec_time_to_first_token_seconds_count")
    assert after[0] == before[0] + 5 and after[1] == before[1] + 1
    assert sample("jspec_kv_pages_total") > 0
    info = json.loads(server.get("/get_server_info"))
    assert info["device_kind"] and info["jax_version"] and info["speculative"] is None
    assert info["page_size"] >= 1 and info["context_length"] > 0


def test_logprobs_and_native_generate(server, model_dir):
    got = server.client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)
    code, r = server.post_raw(
        "/generate",
        json.dumps(
            {"text": "abc", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True}
        ).encode(),
    )
    assert code == 200 and r["output_ids"] == reference(model_dir, ["abc"], 4)[0].token_ids
    assert len(r["meta_info"]["output_token_logprobs"]) == 4
    code, r = server.post_raw("/generate", json.dumps({"text": "abc", "sampling_params": {"bogus": 1}}).encode())
    assert code == 400 and "bogus" in r["error"]["message"]


def test_echo_returns_the_prompt_with_its_logprobs(server, model_dir):
    """/v1/completions with echo: the prompt's text before the completion's, streamed or not,
    and with logprobs the prompt's tokens scored as the engine scores them (None at the first),
    text_offset counting from the start of the returned text."""
    prompt = "Hello there"
    plain = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    got = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    text, lp = got.choices[0].text, got.choices[0].logprobs
    assert text == prompt + plain.choices[0].text
    # The tiny tokenizer opens a prompt with BOS: a token of the prompt's, no text of the echo's.
    bos = "<|begin_of_text|>"
    assert lp.tokens[0] == bos and "".join(lp.tokens) == bos + text
    assert lp.text_offset == [0] + [sum(len(t) for t in lp.tokens[1:k]) for k in range(1, len(lp.tokens))]
    sp = jspec.SamplingParams(max_new_tokens=4, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    ref = reference_with(model_dir, [prompt], sp)[0]
    n = len(ref.prompt_token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:n], ref.input_logprobs[1:], rtol=1e-5)
    np.testing.assert_allclose(lp.token_logprobs[n:], ref.logprobs, rtol=1e-5)
    assert all(len(row) <= 2 for row in lp.top_logprobs[1:])
    # max_tokens 0 (lm-eval's loglikelihood requests): the prompt and its scores alone.
    scored = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=2
    )
    only = scored.choices[0]
    assert only.text == prompt and only.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert only.logprobs.tokens == lp.tokens[:n] and only.logprobs.token_logprobs == lp.token_logprobs[:n]
    streamed = server.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=1, stream=True
    )
    chunks = [c for chunk in streamed for c in chunk.choices]
    assert "".join(c.text for c in chunks) == prompt
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens[:n]
    streamed = server.client.completions.create(
        model="tiny", prompt=[prompt, "jspec"], max_tokens=4, temperature=0, echo=True, stream=True
    )
    texts = {}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == text and texts[1].startswith("jspec")
    code, r = server.post_raw(
        "/generate",
        json.dumps(
            {
                "text": prompt,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
        ).encode(),
    )
    assert code == 200 and [t for _, t in r["meta_info"]["input_token_logprobs"]] == ref.prompt_token_ids
    assert [lp for lp, _ in r["meta_info"]["input_token_logprobs"]][1:] == pytest.approx(
        ref.input_logprobs[1:], rel=1e-5
    )


def test_logit_bias_steers_tokens_through_every_route(server, model_dir):
    """+100 on one token makes it every greedy token (OpenAI's chat route, SGLang's /generate);
    -100 on the unbiased first token keeps it out; an id outside the vocabulary is a 400."""

    def generate(**sampling):
        body = {
            "text": "abc",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, **sampling},
        }
        code, r = server.post_raw("/generate", json.dumps(body).encode())
        assert code == 200, r
        return r["output_ids"]

    free = generate()
    assert generate(logit_bias={"65": 100}) == [65] * 4
    assert free[0] not in generate(logit_bias={str(free[0]): -100})
    forced = server.client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "abc"}],
        max_tokens=4,
        temperature=0,
        logit_bias={"65": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].message.content == jspec.load(model_dir).tokenizer.decode([65] * 4)
    code, err = server.post_raw(
        "/v1/completions", json.dumps({"model": "tiny", "prompt": "abc", "logit_bias": {"99999": 5}}).encode()
    )
    assert code == 400 and "outside the vocabulary" in err["error"]["message"], err


def test_the_readme_server_comes_up_with_no_flags_and_answers_a_chat(tmp_path):
    """scripts/serve.py as the README starts it: the embedded model, warm-up and all. Healthy
    within the start-up budget, in bounded memory, and the openai client gets an answer."""
    from jspec.checkpoint.demo import default_model_path

    port = free_port()
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - closed in the finally below, after the server
    proc = subprocess.Popen(
        [sys.executable, "scripts/serve.py", "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 150
        while time.time() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        log.seek(0)
        out = log.read()
        assert proc.poll() is None and time.time() < deadline, out[-3000:]
        assert "programs ready" in out and "ready:" in out, out[-3000:]
        # Both processes' start-up heaps are frozen out of Python's collections (engine/heap.py).
        assert "engine process: " in out and "HTTP server: " in out and "frozen out of Python's collections" in out
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model,
            max_tokens=16,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        answer = r.choices[0].message.content
        assert answer and r.usage.completion_tokens > 0
        if "SmolLM2" in default_model_path()[1]:  # the real weights, when setup could fetch them
            assert "Paris" in answer, answer
        with open(f"/proc/{proc.pid}/status") as f:
            peak_kb = int(next(line for line in f if line.startswith("VmHWM")).split()[1])
        assert peak_kb <= 4 * 2**20, f"peak resident memory {peak_kb / 2**20:.1f} GiB"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()


def test_disconnects_under_load_log_no_errors_and_hold_nothing(model_dir):
    """32 concurrent streams, completions and chat, some with n > 1, half of them hanging up at
    some point (right after the headers, or after a few chunks), and non-streaming requests whose
    client gives up: the server logs no error, holds no KV page or request slot once idle, and
    serves the next request."""
    import httpx

    srv = Server(model_dir)
    log_path = srv.log.name

    def body(i, n, max_tokens, stream=True):
        b = {
            "model": "tiny",
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "seed": i,
            "n": n,
            "stream": stream,
            "ignore_eos": True,
        }
        if i % 2:
            return "/v1/chat/completions", {**b, "messages": [{"role": "user", "content": f"hello {i}"}]}
        return "/v1/completions", {**b, "prompt": f"request {i}: " + "xy" * (i % 5)}

    async def stream(client, i):
        n, leave_after = (2 if i % 3 == 0 else 1), (None, 0, None, 2, None, 6)[(i // 2) % 6]
        path, b = body(i, n, 24 if leave_after is None else 400)
        chunks, finished = 0, set()
        async with client.stream("POST", path, json=b) as r:
            assert r.status_code == 200
            if leave_after == 0:
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return finished
                chunks += 1
                for c in json.loads(line[6:])["choices"]:
                    if c["finish_reason"] is not None:
                        finished.add(c["index"])
                if chunks == leave_after:
                    return None  # leaving the block closes the connection mid-stream
        raise AssertionError(f"stream {i} ended without [DONE]")

    async def give_up(client, i):
        path, b = body(100 + i, 1 + i % 2, 400, stream=False)
        with pytest.raises(httpx.TimeoutException):
            await client.post(path, json=b, timeout=0.5 + 0.3 * i)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            return await asyncio.gather(
                *[stream(client, i) for i in range(32)], *[give_up(client, i) for i in range(4)]
            )

    try:
        results = asyncio.run(main())[:32]
        for i, finished in enumerate(results):
            if finished is not None:
                assert finished == set(range(2 if i % 3 == 0 else 1)), (i, finished)
        assert sum(f is None for f in results) == 16
        deadline = time.time() + 30
        while True:
            state = json.loads(srv.get("/debug/state"))
            if state["requests"] == 0 or time.time() > deadline:
                break
            time.sleep(0.1)
        assert state["requests"] == state["running"] == state["waiting"] == 0, state
        assert state["kv_pages_free"] + state["kv_pages_cached"] == state["kv_pages_total"], state
        assert state["request_slots_free"] == state["request_slots_total"], state
        ok = srv.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=4, temperature=0
        )
        assert ok.choices[0].message.content is not None and ok.usage.completion_tokens >= 1
    finally:
        assert srv.stop()
    with open(log_path) as f:
        bad = [line for line in f if any(w in line for w in ("Traceback", "Exception", "ERROR", "Task was destroyed"))]
    assert not bad, "".join(bad[:20])

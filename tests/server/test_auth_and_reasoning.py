"""API keys and reasoning output through the official `openai` client, in process: apps over
one engine of a scripted tiny reasoning model (support/models.py: "<think>OK</think>{}" after
a "\\n"), one with an API key, one of each reasoning parser, one with neither.

With an API key every route but /health wants it (401s in OpenAI's shape); without one nothing
asks for it. Both parsers split reasoning_content from content, streamed and not, with and
without the opening tag; a response_format or a forced tool call holds only the text after
</think>."""

import json

import pytest
from support.models import scripted_model

import jspec

pytestmark = pytest.mark.slow  # builds engines, servers or HF references

openai = pytest.importorskip("openai")

# The prompt is the messages' text: where it ends picks where in its script the model starts.
CONCAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# test_structured.py's engine over a model of the same shapes: its programs (the grammar's
# among them) are in the compilation cache when that module ran first.
ENGINE = dict(
    page_size=4,
    max_total_tokens=4096,
    max_running_requests=8,
    precompile_bs_paddings=[8],
    attention_backend="reference",
)
KEY = "sk-test-1234"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "look",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
]


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """{name: (TestClient, openai client)} of the apps over one engine."""
    from fastapi.testclient import TestClient

    from jspec.engine.async_engine import AsyncEngine
    from jspec.server.app import create_app

    path = scripted_model(str(tmp_path_factory.mktemp("auth-reasoning") / "m"), max_position_embeddings=256)
    engine = AsyncEngine(jspec.Engine(jspec.load(path, chat_template=CONCAT), **ENGINE))
    made = {
        "key": create_app(engine, "tiny", api_key=KEY),
        "open": create_app(engine, "tiny"),
        "deepseek-r1": create_app(engine, "tiny", reasoning_parser="deepseek-r1"),
        "qwen3": create_app(engine, "tiny", reasoning_parser="qwen3"),
    }
    http = {name: TestClient(app) for name, app in made.items()}
    try:
        for h in http.values():
            h.__enter__()
        yield {name: (h, client(h, KEY)) for name, h in http.items()}
    finally:
        for h in http.values():
            h.__exit__(None, None, None)
        engine.shutdown()


def client(http, key: str):
    """The official client over an in-process app."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def chat(client, content, stream=False, max_tokens=48, **kw):
    """(reasoning_content, content, finish_reason, tool_calls) of one greedy chat completion."""
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        **kw,
    )
    if not stream:
        m = r.choices[0].message
        return (m.model_extra or {}).get("reasoning_content"), m.content, r.choices[0].finish_reason, m.tool_calls
    reasoning = text = ""
    finish = calls = None
    for chunk in r:
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            calls = c.delta.tool_calls or calls
    return reasoning or None, text or None, finish, calls


def test_an_api_key_guards_every_route_but_health(apps):
    http, guarded = apps["key"]
    assert guarded.models.list().data[0].id == "tiny"  # the right key
    for key in ("sk-wrong", None):  # a wrong key, and none (the client told to send no Authorization)
        omit = {"Authorization": openai.Omit()} if key is None else {}
        with pytest.raises(openai.AuthenticationError) as e:
            client(http, key or KEY).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi\n"}], max_tokens=2, extra_headers=omit
            )
        assert e.value.status_code == 401 and e.value.body["type"] == "invalid_request_error"
        assert e.value.body["code"] == ("invalid_api_key" if key else None)
    assert http.get("/health").status_code == 200
    for method, path in [
        ("get", "/metrics"),
        ("get", "/get_server_info"),
        ("get", "/debug/state"),
        ("post", "/load_lora_adapter"),
        ("post", "/generate"),
        ("get", "/no/such/route"),
    ]:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"}):
            r = getattr(http, method)(path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["message"], (path, headers)
    assert http.get("/get_server_info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # No key configured: no header needed anywhere.
    http, _ = apps["open"]
    assert http.get("/get_server_info").status_code == 200 and http.get("/metrics").status_code == 200
    assert http.post("/generate", json={"text": "hi\n", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_both_parsers_split_reasoning_from_content(apps, stream):
    r1, q3, plain = apps["deepseek-r1"][1], apps["qwen3"][1], apps["open"][1]
    # The model opens with <think>: both parsers split there.
    for c in (r1, q3):
        assert chat(c, "hi\n", stream)[:3] == ("OK", "{}", "stop")
    # The prompt opened the reasoning: deepseek-r1's case; to qwen3 it is all answer.
    assert chat(r1, "hi<think>", stream)[:2] == ("OK", "{}")
    assert chat(q3, "hi<think>", stream)[:2] == (None, "OK</think>{}")
    # No tags at all: deepseek-r1 counts what never closes as reasoning, qwen3 as the answer.
    assert chat(q3, "{", stream)[:2] == (None, "}")
    assert chat(r1, "{", stream)[:2] == ("}", None)
    # Without a parser the text is the content, tags and all.
    assert chat(plain, "hi\n", stream)[:2] == (None, "<think>OK</think>{}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_outputs_and_tool_calls_apply_after_the_reasoning(apps, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "yes", "schema": {"enum": ["yes"]}}}
    forced = {"type": "function", "function": {"name": "look"}}
    for name in ("deepseek-r1", "qwen3"):
        c = apps[name][1]
        # The model wants "{" after </think>; the schema there allows '"yes"' alone.
        assert chat(c, "hi\n", stream, response_format=fmt)[:3] == ("OK", '"yes"', "stop")
        reasoning, content, finish, calls = chat(c, "hi\n", stream, tools=TOOLS, tool_choice=forced)
        assert (reasoning, content, finish) == ("OK", None, "tool_calls")
        assert calls[0].function.name == "look" and json.loads(calls[0].function.arguments) == {}
    # deepseek-r1 with the reasoning opened by the prompt; qwen3 with none: the schema from the start.
    assert chat(apps["deepseek-r1"][1], "hi<think>", stream, response_format=fmt)[:2] == ("OK", '"yes"')
    assert chat(apps["qwen3"][1], "{", stream, response_format=fmt)[:2] == (None, '"yes"')

"""API keys through the official `openai` client, in process: apps over one engine of a
scripted tiny model (support/models.py), one with an API key, one without.

With an API key every route but /health wants it (401s in OpenAI's shape); without one nothing
asks for it."""

import pytest
from support.models import scripted_model

import jspec

openai = pytest.importorskip("openai")

# The prompt is the messages' text: where it ends picks where in its script the model starts.
CONCAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# test_structured.py's engine over a model of the same shapes: its programs are in the
# compilation cache when that module ran first.
ENGINE = dict(
    page_size=4,
    max_total_tokens=4096,
    max_running_requests=8,
    precompile_bs_paddings=[8],
    attention_backend="reference",
)
KEY = "sk-test-1234"


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

"""What a request may ask for, checked before it reaches the engine: the completion length
against one request's room (the context, or the KV pool where that holds less), and the
fields jspec does not implement (OpenAI's, vLLM's and SGLang's), refused by name; unknown ones
logged; chat_template_kwargs. No server: the checks of server/state.py, server/protocol.py and
server/chat_template.py over a tiny engine's facts."""

import types

import jax
import jax.numpy as jnp
import pytest
from support.models import TARGET

import jspec
from jspec.checkpoint.loader import init_random_params
from jspec.config.sampling import MAX_LOGIT_BIAS_TOKENS
from jspec.engine.facts import serving_facts
from jspec.server.chat_template import render_chat
from jspec.server.errors import APIError
from jspec.server.protocol import IGNORED_FIELDS_LOGGED, ChatCompletionRequest, CompletionRequest, check_max_tokens
from jspec.server.state import ServerState

CONTEXT = TARGET.max_position_embeddings


def served(**engine_kw) -> ServerState:
    params = init_random_params(TARGET, jax.random.key(0), jnp.float32)
    engine = jspec.Engine((TARGET, params), page_size=4, attention_backend="reference", **engine_kw)
    return ServerState(types.SimpleNamespace(facts=serving_facts(engine)), "tiny")


@pytest.fixture(scope="module")
def small_pool():
    st = served(max_total_tokens=48)
    assert st.facts.max_request_tokens < CONTEXT
    return st


def test_a_length_left_to_its_default_takes_the_room_the_pool_leaves(small_pool):
    room = small_pool.facts.max_request_tokens
    assert small_pool.check_room(5, None, None) == room - 5
    assert small_pool.check_room(5, room - 5, "max_tokens") == room - 5
    with pytest.raises(APIError, match=f"KV pool holds at most {room} tokens per request") as e:
        small_pool.check_room(5, room - 4, "max_tokens")
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert f"the model's context is {CONTEXT}" in e.value.message
    with pytest.raises(APIError, match=f"{room} tokens in the messages, leaving no room") as e:
        small_pool.check_room(room, None, None, "messages")
    assert e.value.param == "messages"


def test_a_pool_larger_than_the_context_leaves_the_context_as_the_room():
    st = served()
    assert st.facts.max_request_tokens == CONTEXT
    assert st.check_room(10, None, None) == CONTEXT - 10
    with pytest.raises(APIError, match=f"maximum context length is {CONTEXT} tokens"):
        st.check_room(10, CONTEXT - 9, "max_tokens")


def test_unimplemented_openai_fields_are_refused_by_name():
    for body, field in [
        (CompletionRequest(prompt="x", suffix="y"), "suffix"),
        (CompletionRequest(prompt="x", best_of=3), "best_of"),
        (
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], prediction={"type": "content"}),
            "prediction",
        ),
        (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], audio={"voice": "x"}), "audio"),
        (
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], modalities=["text", "audio"]),
            "modalities",
        ),
    ]:
        with pytest.raises(APIError, match=f"^{field} is not implemented by jspec$") as e:
            body.sampling_params(4, False, 0)
        assert e.value.param == field
    chat = [{"role": "user", "content": "x"}]
    for extension, field in [
        ({"min_tokens": 4}, "min_tokens"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"no_stop_trim": True}, "no_stop_trim"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
    ]:
        for body in (CompletionRequest(prompt="x", **extension), ChatCompletionRequest(messages=chat, **extension)):
            with pytest.raises(APIError, match=f"^{field} is not implemented by jspec$"):
                body.sampling_params(4, False, 0)
    for extension, field in [
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"continue_final_message": True}, "continue_final_message"),
    ]:
        with pytest.raises(APIError, match=f"^{field} is not implemented by jspec$"):
            ChatCompletionRequest(messages=chat, **extension).sampling_params(4, False, 0)
    # What asks for nothing unimplemented passes: best_of equal to n, an empty bias, text only.
    CompletionRequest(prompt="x", best_of=2, n=2, logit_bias={}).sampling_params(4, False, 0)
    ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], modalities=["text"]).sampling_params(4, False, 0)


def test_logit_bias_reaches_the_sampling_params_as_token_ids():
    sp = CompletionRequest(prompt="x", logit_bias={"5": 10, "7": -100}).sampling_params(4, False, 0)
    assert sp.logit_bias == {5: 10.0, 7: -100.0}
    for bias, words in [
        ({"x": 1}, "keys must be token ids"),
        ({"5": 101}, r"values must be numbers in \[-100, 100\]"),
        ({str(i): 1 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}, f"at most {MAX_LOGIT_BIAS_TOKENS} tokens"),
    ]:
        with pytest.raises(APIError, match=words) as e:
            ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logit_bias=bias).sampling_params(
                4, False, 0
            )
        assert e.value.param == "logit_bias"


def test_completion_lengths_below_one_and_non_finite_temperatures_are_refused():
    assert check_max_tokens(None, "max_tokens") is None and check_max_tokens(3, "max_tokens") == 3
    with pytest.raises(APIError, match="max_tokens must be at least 1, got 0$"):
        check_max_tokens(0, "max_tokens")
    assert check_max_tokens(0, "max_tokens", least=0) == 0  # /v1/completions: the echoed prompt alone
    with pytest.raises(APIError, match="max_tokens must be at least 0, got -1$"):
        check_max_tokens(-1, "max_tokens", least=0)
    with pytest.raises(APIError, match="max_completion_tokens must be at least 1, got -2$"):
        check_max_tokens(-2, "max_completion_tokens")
    for t in (float("nan"), float("inf")):
        with pytest.raises(APIError, match="temperature must be a finite number"):
            CompletionRequest(prompt="x", temperature=t).sampling_params(4, False, 0)


def test_fields_no_schema_names_are_ignored_and_logged_once(caplog):
    body = CompletionRequest(prompt="x", metadata={"k": "v"}, store=False)
    assert body.ignored() == ["metadata", "store"]
    IGNORED_FIELDS_LOGGED.difference_update({"metadata", "store"})
    with caplog.at_level("WARNING", logger="jspec.server"):
        body.sampling_params(4, False, 0)
        body.sampling_params(4, False, 0)
    assert [r.getMessage() for r in caplog.records].count(
        "request fields jspec ignores (logged once each): ['metadata', 'store']"
    ) == 1


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_its_inputs():
    tok = types.SimpleNamespace(
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}{% if enable_thinking is false %}/no_think{% endif %}",
        bos_token="",
        eos_token="",
    )
    chat = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, chat) == "hi>"
    assert render_chat(tok, chat, template_kwargs={"enable_thinking": False}) == "hi>/no_think"
    assert render_chat(tok, chat, add_generation_prompt=False) == "hi"
    with pytest.raises(APIError, match=r"may not set \['messages'\]"):
        render_chat(tok, chat, template_kwargs={"messages": []})

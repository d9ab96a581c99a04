"""What a request may ask for, checked before it reaches the engine: the completion length
against one request's room (the context, or the KV pool where that holds less), and the
OpenAI fields jspec does not implement, refused by name. No server: the checks of
server/state.py and server/protocol.py over a tiny engine's facts."""

import types

import jax
import jax.numpy as jnp
import pytest
from support.models import TARGET

import jspec
from jspec.checkpoint.loader import init_random_params
from jspec.engine.facts import serving_facts
from jspec.server.errors import APIError
from jspec.server.protocol import ChatCompletionRequest, CompletionRequest, check_max_tokens
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
        (CompletionRequest(prompt="x", logit_bias={"5": 10}), "logit_bias"),
        (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logit_bias={"5": -100}), "logit_bias"),
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
    # What asks for nothing unimplemented passes: best_of equal to n, an empty bias, text only.
    CompletionRequest(prompt="x", best_of=2, n=2, logit_bias={}).sampling_params(4, False, 0)
    ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], modalities=["text"]).sampling_params(4, False, 0)


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

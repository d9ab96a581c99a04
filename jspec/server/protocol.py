"""OpenAI- and SGLang-shaped request bodies, their validation, and OpenAI's error shape.

Bodies are pydantic models (FastAPI's own validation): a known field of the wrong type is a
400 with the field named; unknown fields are ignored, as OpenAI's API does.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jspec.config.sampling import SamplingParams
from jspec.server.errors import APIError

# Each stop string is matched against every new piece of a request's text on the engine thread,
# so an unbounded list would let one request slow down all the others. OpenAI takes 4 and SGLang
# has no limit; this is far above what clients send.
MAX_STOP_STRINGS = 64

# OpenAI's chat roles ("function" is deprecated there, and not taken here).
ChatRole = Literal["system", "user", "assistant", "tool", "developer"]


def check_stop(stop, param: str = "stop") -> list[str]:
    """A request's stop strings as a list: a string or a list of at most MAX_STOP_STRINGS
    strings (SamplingParams refuses empty ones)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise APIError(f"{param} must be a string or a list of strings", param=param)
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(f"{param}: at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}", param=param)
    return list(stop)


log = logging.getLogger("jspec.server")
# Unknown request fields already logged by this process.
IGNORED_FIELDS_LOGGED: set[str] = set()


def check_max_tokens(value: int | None, param: str, least: int = 1) -> int | None:
    """A completion length the client set (None: unset); least is 0 where a completion of no
    tokens means something (/v1/completions: the echoed prompt's logprobs alone)."""
    if value is not None and value < least:
        raise APIError(f"{param} must be at least {least}, got {value}", param=param)
    return value


class StreamOptions(BaseModel):
    include_usage: bool = True


class _Sampling(BaseModel):
    """Sampling fields common to completions and chat (OpenAI's names plus SGLang's extensions)."""

    # Fields this schema does not name are kept (model_extra) only to be logged as ignored.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    user: str | None = None
    lora_path: str | None = None  # SGLang's extension: a loaded LoRA adapter's name (or model "base:adapter")
    # Structured output: OpenAI's response_format, or SGLang's extensions (at most one of all).
    response_format: dict[str, Any] | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON text) -> value in [-100, 100]
    # vLLM's and SGLang's extensions that change the output, which jspec does not implement:
    # refused by name when set (unimplemented()), as a silently ignored one would change what
    # the client gets.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False

    def unimplemented(self) -> list[str]:
        """The fields of this body that ask for something jspec does not do."""
        asked = [
            f
            for f in ("min_tokens", "include_stop_str_in_output", "no_stop_trim", "use_beam_search")
            if getattr(self, f)
        ]
        asked += [f for f in ("skip_special_tokens", "spaces_between_special_tokens") if not getattr(self, f)]
        return asked

    def ignored(self) -> list[str]:
        """Fields of this body that no schema here names (OpenAI's metadata, store, ...): ignored."""
        return sorted(self.model_extra or ())

    def grammar(self) -> dict[str, str]:
        """The SamplingParams grammar field this body asks for ({} for free text)."""
        asked = {k: getattr(self, k) for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None}
        if isinstance(asked.get("json_schema"), dict):
            asked["json_schema"] = json.dumps(asked["json_schema"])
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                asked["response_format"] = '{"type": "object"}'
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(
                        "response_format json_schema needs json_schema.schema, a JSON schema object",
                        param="response_format",
                    )
                asked["response_format"] = json.dumps(schema)
            elif kind != "text":
                raise APIError(
                    f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                    param="response_format",
                )
        if len(asked) > 1:
            raise APIError(f"give at most one of response_format, json_schema, regex and ebnf, got {sorted(asked)}")
        if "response_format" in asked:
            return {"json_schema": asked["response_format"]}
        return asked

    def sampling_params(
        self,
        max_new_tokens: int,
        return_logprob: bool,
        top_logprobs: int,
        lora_path: str | None = None,
        grammar: dict[str, str] | None = None,
        reasoning_format: str | None = None,
    ) -> SamplingParams:
        for field in self.unimplemented():
            raise APIError(f"{field} is not implemented by jspec", param=field)
        unseen = [f for f in self.ignored() if f not in IGNORED_FIELDS_LOGGED]
        if unseen:
            IGNORED_FIELDS_LOGGED.update(unseen)
            log.warning("request fields jspec ignores (logged once each): %s", unseen)
        stop = check_stop(self.stop)
        grammar = self.grammar() if grammar is None else grammar
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=self.seed,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                repetition_penalty=self.repetition_penalty,
                return_logprob=return_logprob,
                top_logprobs_num=top_logprobs,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                logit_bias=self.logit_bias,
                ignore_eos=self.ignore_eos,
                n=self.n,
                lora_path=lora_path,
                reasoning_format=reasoning_format,
                **grammar,
            )
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(" ", 1)[0]) from None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # None: OpenAI's 16 (server/openai.py), within the room left
    logprobs: int | None = None  # top-n logprobs per token (0: the chosen token's only)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unimplemented(self) -> list[str]:
        asked = super().unimplemented()
        if self.suffix:
            asked.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            asked.append("best_of")
        return asked


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    parallel_tool_calls: bool = True
    # vLLM's and SGLang's chat template controls.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def unimplemented(self) -> list[str]:
        asked = super().unimplemented()
        asked += [f for f in ("prediction", "audio") if getattr(self, f) is not None]
        if not self.parallel_tool_calls:
            asked.append("parallel_tool_calls")
        if self.continue_final_message:
            asked.append("continue_final_message")
        if self.modalities not in (None, ["text"]):
            asked.append("modalities")
        return asked


class GenerateRequest(BaseModel):
    """SGLang's native /generate body."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    rid: str | None = None
    lora_path: str | None = None  # a loaded LoRA adapter's name


class LoadLoraRequest(BaseModel):
    """SGLang's /load_lora_adapter body (also /unload_lora_adapter, which needs no path)."""

    lora_name: str = Field(min_length=1)
    lora_path: str | None = None


def message_text(m: ChatMessage) -> str:
    """A message's text (OpenAI's content parts: only text parts are supported)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts = []
    for part in m.content:
        if part.get("type") != "text":
            raise APIError(f"content part type {part.get('type')!r} is not supported (text only)", param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


FinishReason = Literal["stop", "length", "abort"]

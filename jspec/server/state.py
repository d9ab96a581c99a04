"""What the routes of one app share: the engine, the served model's name, the metrics, and the
checks that turn a request into engine input, so that every API validates alike.

The engine is an AsyncEngine (its loop on a thread of this process) or an EngineProcess (in a
process of its own, `jspec serve`'s): the routes read only what both give, the engine's facts
(EngineFacts, fixed while it serves) and its stats (EngineStats, asked for), never the Engine.

The routers are module-level; each app keeps its ServerState in app.state and a route gets it
through the `Served` dependency, so one process can serve several apps (the tests do).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from jspec.checkpoint.model import Model
from jspec.engine.async_engine import AsyncEngine
from jspec.engine.engine_process import EngineProcess
from jspec.engine.outputs import tokenize_prompt
from jspec.server.errors import APIError
from jspec.server.metrics import ServerMetrics


class ServerState:
    def __init__(self, engine: AsyncEngine | EngineProcess, model_name: str, reasoning_parser: str | None = None):
        self.engine = engine
        self.reasoning_parser = reasoning_parser  # a REASONING_FORMATS name, or None
        self.facts = facts = engine.facts
        self.tokenizer = facts.tokenizer
        self.model = Model(facts.model_cfg, None, facts.tokenizer)  # no weights: what prompts are checked against
        self.model_name = model_name
        self.metrics = ServerMetrics(facts.adaptive)
        self.max_top = facts.max_top_logprobs

    def check_model(self, name: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request asks for (None: the base model), named by OpenAI's `model`
        as "base:adapter" (as SGLang) or by SGLang's `lora_path` field."""
        adapter = None
        model_name = self.model_name
        if name is not None and name != model_name:
            base, sep, rest = name.partition(":")
            if not (sep and rest and base == model_name):
                raise APIError(
                    f"The model `{name}` does not exist; this server serves `{model_name}` (and its LoRA "
                    f"adapters as `{model_name}:ADAPTER`)",
                    404,
                    param="model",
                    code="model_not_found",
                )
            adapter = rest
        if lora_path is not None and adapter is not None and lora_path != adapter:
            raise APIError(f"model names adapter {adapter!r} but lora_path names {lora_path!r}", param="lora_path")
        return lora_path if lora_path is not None else adapter

    def check_prompt(self, prompt) -> list[int]:
        try:
            return tokenize_prompt(prompt, self.model)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), param="prompt") from None

    def check_room(
        self, prompt_tokens: int, max_new_tokens: int | None, param: str | None, prompt: str = "prompt"
    ) -> int:
        """The completion length of a request: the one the client asked for (param names its
        field), refused as OpenAI does if the prompt and it do not fit one request's room, or,
        left to its default (param None), all the room the prompt leaves. The room is the
        model's context, or what the KV pool holds where that is less, so that a request the
        pool could never hold is refused here, not by the scheduler."""
        context = self.model.cfg.max_position_embeddings
        limit = self.facts.max_request_tokens
        if param is None:
            max_new_tokens = limit - prompt_tokens
        if prompt_tokens + max(max_new_tokens, 1) <= limit:
            return max_new_tokens
        asked = f"{prompt_tokens + max_new_tokens} tokens ({prompt_tokens} in the {prompt}, {max_new_tokens} in the completion)"
        if param is None:
            asked = f"{prompt_tokens} tokens in the {prompt}, leaving no room for a completion"
        where = f"This model's maximum context length is {context} tokens"
        if limit < context:
            where = f"This server's KV pool holds at most {limit} tokens per request (the model's context is {context})"
        raise APIError(
            f"{where}. However, you requested {asked}. Please reduce the length of the {prompt} or completion.",
            param=param or prompt,
            code="context_length_exceeded",
        )

    def token_text(self, t: int, skip_special_tokens: bool = False) -> str:
        tok = self.tokenizer
        return tok.decode([t], skip_special_tokens=skip_special_tokens) if tok is not None else str(t)


# Async, though it awaits nothing: FastAPI runs a plain function dependency on a worker thread,
# a thread hop for every request.
async def _state(request: Request) -> ServerState:
    return request.app.state.served


Served = Annotated[ServerState, Depends(_state)]

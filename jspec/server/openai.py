"""OpenAI's API: /v1/completions, /v1/chat/completions and /v1/models, in the shapes the
official client parses (choices, usage, logprobs, server-sent event chunks)."""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request

from jspec.server.chat_template import render_chat
from jspec.server.errors import APIError
from jspec.server.protocol import ChatCompletionRequest, CompletionRequest, check_max_tokens, message_text
from jspec.server.reasoning import ReasoningSplitter, split_reasoning
from jspec.server.state import Served, ServerState
from jspec.server.streaming import (
    Choice,
    ChunkEvents,
    EventStream,
    close,
    collect,
    merged,
    openai_finish,
    sse,
    start,
    usage,
)
from jspec.server.tools import check_tools, parse_tool_calls, tool_call_schema

router = APIRouter()


def completion_logprobs(st: ServerState, token_ids, logprobs, top, n_top: int, offset: int) -> dict:
    """/v1/completions' logprobs of these tokens, whose text starts at character offset of the
    choice's text (a special token, such as an echoed prompt's BOS, takes no room in it). A None
    in top (an echoed prompt's first token) stays None."""
    tokens = [st.token_text(t) for t in token_ids]
    offsets = []
    for t in token_ids:
        offsets.append(offset)
        offset += len(st.token_text(t, skip_special_tokens=True))
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": [None if row is None else {st.token_text(t): lp for t, lp in row} for row in top]
        if n_top
        else None,
        "text_offset": offsets,
    }


def joined_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    top = None if a["top_logprobs"] is None else a["top_logprobs"] + b["top_logprobs"]
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "text_offset")} | {"top_logprobs": top}


class CompletionChunks:
    """Each /v1/completions choice's text and logprobs, chunk by chunk (one chunk when not
    streamed): with echo, the prompt's text (and, with logprobs, its scores from the first
    token) opens the choice's first chunk; text_offset counts from the start of the choice."""

    def __init__(self, st: ServerState, prompts, ids, body: CompletionRequest):
        self.st, self.ids, self.n, self.echo, self.n_top = st, ids, body.n, body.echo, body.logprobs or 0
        # max_tokens 0: the engine generates one token (it cannot take none), which no chunk shows.
        self.no_completion = body.max_tokens == 0
        self.with_logprobs = body.logprobs is not None
        self.texts = []  # the prompts as echoed
        if self.echo:
            if st.tokenizer is None and not all(isinstance(p, str) for p in prompts):
                raise APIError("echo of a prompt of token ids needs the model's tokenizer", param="echo")
            self.texts = [p if isinstance(p, str) else st.tokenizer.decode(i) for p, i in zip(prompts, ids)]
        self.sent: dict[int, int] = {}  # choice index -> characters of its text sent so far

    def chunk(self, i: int, c: Choice) -> tuple[str, dict | None]:
        """Choice i's next text and logprobs; c holds what it produced since its last chunk."""
        first = i not in self.sent
        prefix = self.texts[i // self.n] if self.echo and first else ""
        start = self.sent.get(i, 0) + len(prefix)
        own_ids, own_text = ([], "") if self.no_completion else (c.token_ids, c.text)
        logprobs = None
        if self.with_logprobs:
            prompt = None
            if prefix:
                ids = self.ids[i // self.n]
                prompt = completion_logprobs(self.st, ids, c.input_logprobs, c.input_top_logprobs, self.n_top, 0)
            n = len(own_ids)
            own = completion_logprobs(self.st, own_ids, c.logprobs[:n], c.top_logprobs[:n], self.n_top, start)
            logprobs = joined_logprobs(prompt, own)
        self.sent[i] = start + len(own_text)
        return prefix + own_text, logprobs

    def completion_tokens(self, tokens: int) -> int:
        return 0 if self.no_completion else tokens

    def finish(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason: a completion of no tokens ends by its length, whatever ended the
        one token the engine made."""
        return "length" if self.no_completion and reason is not None else openai_finish(reason)


def chat_logprobs(st: ServerState, token_ids, logprobs, top) -> dict:
    text = st.token_text
    content = []
    for j, (t, lp) in enumerate(zip(token_ids, logprobs)):
        s = text(t)
        content.append(
            {
                "token": s,
                "logprob": lp,
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": text(a), "logprob": b, "bytes": list(text(a).encode())}
                    for a, b in (top[j] if j < len(top) else [])
                ],
            }
        )
    return {"content": content}


# OpenAI's completion length when a /v1/completions body gives none (chat's is all the room left).
COMPLETION_DEFAULT_MAX_TOKENS = 16


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, st: Served):
    adapter = st.check_model(body.model, body.lora_path)
    t0 = time.perf_counter()
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise APIError("prompt is empty", param="prompt")
    n_top = body.logprobs or 0
    if n_top > st.max_top:
        raise APIError(f"logprobs={n_top} exceeds this server's --max-top-logprobs={st.max_top}", param="logprobs")
    ids = [st.check_prompt(p) for p in prompts]
    longest = max(len(p) for p in ids)
    if body.max_tokens is None:
        max_new = min(COMPLETION_DEFAULT_MAX_TOKENS, st.check_room(longest, None, None))
    else:
        max_new = st.check_room(longest, max(check_max_tokens(body.max_tokens, "max_tokens", least=0), 1), "max_tokens")
    params = body.sampling_params(max_new, body.logprobs is not None, n_top, adapter)
    if body.echo and body.logprobs is not None:
        params.logprob_start_len = 0  # the echoed prompt's logprobs, scored from its first token
    texts = CompletionChunks(st, prompts, ids, body)
    streams = []
    try:
        for i, p in enumerate(ids):
            streams += await start(st.engine, p, params, i * body.n)
    except APIError:
        await close(streams)
        raise
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": st.model_name}
    prompt_tokens = sum(len(p) for p in ids) * body.n
    if not body.stream:
        choices = await collect(streams, st.metrics.observer(t0), request)
        out = []
        for c in sorted(choices.values(), key=lambda c: c.index):
            text, logprobs = texts.chunk(c.index, c)
            out.append(
                {
                    "index": c.index,
                    "text": text,
                    "finish_reason": texts.finish(c.finish_reason),
                    "matched_stop": None if texts.no_completion else c.matched_stop,
                    "logprobs": logprobs,
                }
            )
        completion = texts.completion_tokens(sum(c.completion_tokens for c in choices.values()))
        spec = [(c.completion_tokens, c.verify_ct) for c in choices.values()]
        return {**head, "choices": out, "usage": usage(prompt_tokens, completion, spec)}

    async def events():
        completion, verify = {}, {}
        chunks = ChunkEvents(head)
        plain = body.logprobs is None and not body.echo and not texts.no_completion  # text-only chunks: the fast path
        async with aclosing(merged(streams, st.metrics.observer(t0))) as outputs:
            async for i, out in outputs:
                completion[i], verify[i] = out.completion_tokens, out.spec_verify_ct
                if not out.finished and plain:
                    if out.new_text:
                        yield chunks.text(i, out.new_text)
                    continue
                c = Choice(i)
                c.add(out)
                text, logprobs = texts.chunk(i, c)
                if text or out.finished or (logprobs and logprobs["tokens"]):
                    choice = {
                        "index": i,
                        "text": text,
                        "finish_reason": texts.finish(out.finish_reason) if out.finished else None,
                        "logprobs": logprobs,
                    }
                    yield chunks.choice(choice)
        total = texts.completion_tokens(sum(completion.values()))
        spec = [(completion[i], verify[i]) for i in completion]
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, total, spec)})
        yield "data: [DONE]\n\n"

    return EventStream(events(), streams)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, st: Served):
    adapter = st.check_model(body.model, body.lora_path)
    t0 = time.perf_counter()
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    n_top = body.top_logprobs or 0
    if n_top > st.max_top:
        raise APIError(
            f"top_logprobs={n_top} exceeds this server's --max-top-logprobs={st.max_top}", param="top_logprobs"
        )
    functions, tool_choice = check_tools(body.tools, body.tool_choice)
    grammar = None
    if tool_choice not in (None, "auto"):
        if body.grammar():
            raise APIError(
                "a forced tool_choice constrains the output itself; drop response_format", param="tool_choice"
            )
        grammar = {"json_schema": tool_call_schema(functions, tool_choice)}
    text = render_chat(
        st.tokenizer,
        [{**m.model_dump(exclude_none=True), "content": message_text(m)} for m in body.messages],
        add_generation_prompt=body.add_generation_prompt,
        tools=body.tools if tool_choice is not None else None,
        template_kwargs=body.chat_template_kwargs,
    )
    ids = st.tokenizer.encode(text, add_special_tokens=False)
    ids = st.check_prompt(ids)
    # The length field the client set, OpenAI's newer name first (None: neither).
    asked = next((f for f in ("max_completion_tokens", "max_tokens") if getattr(body, f) is not None), None)
    max_new = st.check_room(len(ids), asked and check_max_tokens(getattr(body, asked), asked), asked, "messages")
    # With a reasoning parser, a grammar (response_format, a forced tool call) holds only the
    # text after the reasoning.
    parser = st.reasoning_parser
    params = body.sampling_params(max_new, body.logprobs, n_top, adapter, grammar, parser)
    streams = await start(st.engine, ids, params, 0)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": st.model_name}
    prompt_tokens = len(ids) * body.n
    if not body.stream:
        choices = await collect(streams, st.metrics.observer(t0), request)
        ordered = sorted(choices.values(), key=lambda c: c.index)
        out = [chat_choice(st, body, c, parser, functions, tool_choice) for c in ordered]
        completion = sum(c.completion_tokens for c in choices.values())
        spec = [(c.completion_tokens, c.verify_ct) for c in choices.values()]
        return {**head, "object": "chat.completion", "choices": out, "usage": usage(prompt_tokens, completion, spec)}
    chunk = {**head, "object": "chat.completion.chunk"}
    events = chat_events(st, body, streams, chunk, t0, prompt_tokens, parser, functions, tool_choice)
    return EventStream(events, streams)


def chat_choice(st: Served, body: ChatCompletionRequest, c, parser, functions, tool_choice) -> dict:
    """One finished choice of a non-streamed chat completion: its reasoning split off, its tool
    calls parsed out of the answer."""
    reasoning, text = split_reasoning(parser, c.text) if parser else (None, c.text)
    content, calls = parse_tool_calls(text, functions, tool_choice)
    message = {"role": "assistant", "content": content}
    if parser:  # as SGLang: None for an empty part
        message.update(content=content or None, reasoning_content=reasoning or None)
    if calls:
        message["tool_calls"] = calls
    finish = openai_finish(c.finish_reason)
    return {
        "index": c.index,
        "message": message,
        "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
        "matched_stop": c.matched_stop,
        "logprobs": chat_logprobs(st, c.token_ids, c.logprobs, c.top_logprobs) if body.logprobs else None,
    }


def chat_chunk(chunks: ChunkEvents, index: int, delta: dict, finish_reason=None, logprobs=None) -> str:
    return chunks.choice({"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs})


async def chat_events(st: Served, body, streams, chunk, t0, prompt_tokens, parser, functions, tool_choice):
    """A streamed chat completion's server-sent events: a role delta first for each choice, then
    its text (the reasoning apart, with a parser; with tools, the answer as one delta at its end),
    and the usage last."""
    completion, verify, started, held = {}, {}, set(), {}
    splitters = {}  # each choice's ReasoningSplitter, with a reasoning parser
    chunks = ChunkEvents(chunk)
    async with aclosing(merged(streams, st.metrics.observer(t0))) as outputs:
        async for i, out in outputs:
            completion[i], verify[i] = out.completion_tokens, out.spec_verify_ct
            if i not in started:
                started.add(i)
                yield chat_chunk(chunks, i, {"role": "assistant", "content": ""})
            lp = (
                chat_logprobs(st, out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs or [])
                if body.logprobs and out.new_token_ids
                else None
            )
            reasoning, text = "", out.new_text
            if parser:
                splitter = splitters.setdefault(i, ReasoningSplitter(parser))
                reasoning, text = splitter.feed(out.new_text, final=out.finished)
            if tool_choice is not None:
                # Calls are parsed from the whole text: a choice with tools streams its answer as
                # one delta at its end (content and tool_calls, as the non-streamed message); its
                # reasoning streams as it comes.
                held[i] = held.get(i, "") + text
                if reasoning:
                    yield chat_chunk(chunks, i, {"reasoning_content": reasoning})
                if not out.finished:
                    continue
                content, calls = parse_tool_calls(held.pop(i), functions, tool_choice)
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(calls)]
                finish = openai_finish(out.finish_reason)
                yield chat_chunk(chunks, i, delta, "tool_calls" if calls and finish == "stop" else finish)
                continue
            if text and not (reasoning or out.finished or lp):
                yield chunks.content(i, text)
            elif text or reasoning or out.finished or lp:
                delta = {"reasoning_content": reasoning} if reasoning else {}
                if text:
                    delta["content"] = text
                yield chat_chunk(chunks, i, delta, openai_finish(out.finish_reason) if out.finished else None, lp)
    total = sum(completion.values())
    spec = [(completion[i], verify[i]) for i in completion]
    yield sse({**chunk, "choices": [], "usage": usage(prompt_tokens, total, spec)})
    yield "data: [DONE]\n\n"


@router.get("/v1/models")
async def models(st: Served):
    name, cfg = st.model_name, st.model.cfg
    adapters = sorted((await st.engine.stats()).lora_adapters)
    return {
        "object": "list",
        "data": [
            {
                "id": m,
                "object": "model",
                "created": 0,
                "owned_by": "jspec",
                "root": name,
                "max_model_len": st.facts.max_request_tokens,
                "vocab_size": cfg.vocab_size,
            }
            for m in [name] + [f"{name}:{a}" for a in adapters]
        ],
    }

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


def completion_logprobs(st: ServerState, c: Choice, n_top: int) -> dict:
    return {
        "tokens": [st.token_text(t) for t in c.token_ids],
        "token_logprobs": c.logprobs,
        "top_logprobs": [{st.token_text(t): lp for t, lp in row} for row in c.top_logprobs] if n_top else None,
        "text_offset": [],
    }


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
        max_new = st.check_room(longest, check_max_tokens(body.max_tokens, "max_tokens"), "max_tokens")
    params = body.sampling_params(max_new, body.logprobs is not None, n_top, adapter)
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
        out = [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": openai_finish(c.finish_reason),
                "matched_stop": c.matched_stop,
                "logprobs": completion_logprobs(st, c, n_top) if body.logprobs is not None else None,
            }
            for c in sorted(choices.values(), key=lambda c: c.index)
        ]
        completion = sum(c.completion_tokens for c in choices.values())
        spec = [(c.completion_tokens, c.verify_ct) for c in choices.values()]
        return {**head, "choices": out, "usage": usage(prompt_tokens, completion, spec)}

    async def events():
        completion, verify = {}, {}
        chunks = ChunkEvents(head)
        with_logprobs = body.logprobs is not None
        async with aclosing(merged(streams, st.metrics.observer(t0))) as outputs:
            async for i, out in outputs:
                completion[i], verify[i] = out.completion_tokens, out.spec_verify_ct
                if not out.finished and not with_logprobs:
                    if out.new_text:
                        yield chunks.text(i, out.new_text)
                    continue
                choice = {
                    "index": i,
                    "text": out.new_text,
                    "finish_reason": openai_finish(out.finish_reason) if out.finished else None,
                    "logprobs": None,
                }
                if with_logprobs and out.new_token_ids:
                    c = Choice(i)
                    c.add(out)
                    choice["logprobs"] = completion_logprobs(st, c, n_top)
                if out.new_text or out.finished or choice["logprobs"]:
                    yield chunks.choice(choice)
        total = sum(completion.values())
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
        tools=body.tools if tool_choice is not None else None,
    )
    ids = st.tokenizer.encode(text, add_special_tokens=False)
    ids = st.check_prompt(ids)
    asked = (
        "max_completion_tokens"
        if body.max_completion_tokens is not None
        else "max_tokens"
        if body.max_tokens is not None
        else None
    )
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

"""Engine streams as the routes read them: a request's n completions started together, merged
into one stream, collected into choices or sent as server-sent events.

Invariant: an engine stream (an async generator) is closed only by the task that iterates it,
or when no task is inside it; a client that leaves gets its unfinished requests aborted, which
frees their KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from json.encoder import encode_basestring as encode_str
from typing import NamedTuple

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from jspec.config.sampling import SamplingParams
from jspec.engine.async_engine import AsyncEngine
from jspec.engine.engine import RequestOutput
from jspec.engine.engine_process import EngineProcess
from jspec.server.errors import APIError


class Choice:
    """One completion (one prompt x one of n) as it streams: text, tokens, logprobs, finish."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        # The prompt's logprobs, when asked for (None at its first token).
        self.input_logprobs: list[float | None] = []
        self.input_top_logprobs: list[list[tuple[int, float]] | None] = []
        self.finish_reason: str | None = None
        self.matched_stop = None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = self.verify_ct = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.top_logprobs += out.new_top_logprobs or []
        self.input_logprobs = out.input_logprobs or self.input_logprobs
        self.input_top_logprobs = out.input_top_logprobs or self.input_top_logprobs
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens, self.verify_ct = out.cached_tokens, out.spec_verify_ct
        if out.finished:
            self.finish_reason, self.matched_stop = out.finish_reason, out.matched_stop


def openai_finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int, spec: list[tuple[int, int]] = ()) -> dict:
    """OpenAI's usage; with speculation also spec_accept_length (SGLang's meta_info name): tokens
    emitted per verify iteration over the choices, spec: (completion tokens, iterations) each."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    iterations = sum(v for _, v in spec)
    if iterations:
        # The first token of each choice comes from the prefill, not from a verify.
        out["spec_accept_length"] = sum(max(c - 1, 0) for c, v in spec if v) / iterations
    return out


# json.dumps with ensure_ascii=False builds a new encoder at every call; this one is made once.
_encode = json.JSONEncoder(ensure_ascii=False).encode


def sse(obj) -> str:
    return f"data: {_encode(obj)}\n\n"


class ChunkEvents:
    """The server-sent events of one streamed response's chunks, {**head, "choices": [choice]},
    byte for byte as sse() writes them, with the head encoded once: a chunk then costs the
    encoding of its choice alone, and a text chunk only its text's."""

    def __init__(self, head: dict):
        self.prefix = "data: " + _encode(head)[:-1] + ', "choices": ['

    def choice(self, choice: dict) -> str:
        return f"{self.prefix}{_encode(choice)}]}}\n\n"

    def text(self, index: int, text: str) -> str:
        """A completion chunk that only adds text: {"index", "text", "finish_reason": null, "logprobs": null}."""
        return (
            f'{self.prefix}{{"index": {index}, "text": {encode_str(text)}, '
            f'"finish_reason": null, "logprobs": null}}]}}\n\n'
        )

    def content(self, index: int, text: str) -> str:
        """A chat chunk whose delta is only content, not the last one, without logprobs."""
        return (
            f'{self.prefix}{{"index": {index}, "delta": {{"content": {encode_str(text)}}}, '
            f'"finish_reason": null, "logprobs": null}}]}}\n\n'
        )


class Stream(NamedTuple):
    """One completion's engine stream (AsyncEngine.stream or EngineProcess.stream), already past its first output."""

    index: int
    outputs: AsyncGenerator[RequestOutput, None]
    first: RequestOutput


async def start(
    engine: AsyncEngine | EngineProcess, ids: list[int], params: SamplingParams, base_index: int
) -> list[Stream]:
    """Submits params.n copies (consecutive seeds) and returns their streams, each already past its
    first output, so that a request the engine refuses fails before any response is sent."""
    streams = []
    if params.grammar is not None:
        # Compiled now, on a thread beside the engine's loop, into the engine's cache: the
        # loop only copies it, and a grammar llguidance rejects is the client's 400.
        try:
            await engine.check_grammar(params)
        except ValueError as e:
            raise APIError(str(e), param=params.grammar[0]) from None
    try:
        for k, p in enumerate(params.completions()):
            agen = engine.stream(ids, p)
            first = await agen.__anext__()
            streams.append(Stream(base_index + k, agen, first))
    except (ValueError, RuntimeError) as e:
        await close(streams)
        status = getattr(e, "status", 400)  # RequestFailed: the server's fault, not the request's
        raise APIError(str(e), status, "server_error" if status >= 500 else "invalid_request_error") from None
    return streams


async def close(streams: list[Stream]) -> None:
    """Closes the streams that no task is inside, which aborts their requests if unfinished. A
    stream that a pump of merged() is reading is that pump's to close: an async generator cannot
    be closed while another task is suspended in it."""
    for s in streams:
        if not s.outputs.ag_running:
            await s.outputs.aclose()


_DONE = object()


async def merged(
    streams: list[Stream], observe: Callable[[int, RequestOutput], None]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from every stream as they come, each passed to observe first; closing it
    early aborts the unfinished requests.

    One stream is read and closed by the task reading this. Several are each read by a pump
    task of their own, and only that task closes it. Leaving early (the client disconnected,
    which cancels the task reading this) cancels the pumps: each one unwinds its stream, whose
    request is aborted then.
    """
    if len(streams) == 1:  # one stream needs no pump: this task reads it, and closes it
        s = streams[0]
        async with contextlib.aclosing(s.outputs):
            observe(s.index, s.first)
            yield s.index, s.first
            if not s.first.finished:
                async for out in s.outputs:
                    observe(s.index, out)
                    yield s.index, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(s: Stream):
        try:
            async with contextlib.aclosing(s.outputs):
                queue.put_nowait((s.index, s.first))
                if not s.first.finished:
                    async for out in s.outputs:
                        queue.put_nowait((s.index, out))
        except Exception as e:  # noqa: BLE001 - raised by the consumer
            queue.put_nowait((s.index, e))
        finally:
            queue.put_nowait((s.index, _DONE))

    pumps = [asyncio.create_task(pump(s)) for s in streams]
    live = len(pumps)
    try:
        while live:
            index, item = await queue.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                observe(index, item)
                yield index, item
    finally:
        for t in pumps:
            t.cancel()
        # Shielded: a disconnect cancels the task reading this through a cancel scope, which
        # cancels it again at every await until the scope exits; the pumps' wait is short (an
        # abort is a message to the engine thread).
        with anyio.CancelScope(shield=True):
            if pumps:
                await asyncio.wait(pumps)
            await close(streams)  # those of pumps cancelled before their first step


async def collect(streams: list[Stream], observe, request: Request) -> dict[int, Choice]:
    """Runs streams to the end; aborts them if the client disconnects meanwhile."""
    choices = {s.index: Choice(s.index) for s in streams}

    async def consume():
        async with contextlib.aclosing(merged(streams, observe)) as outputs:
            async for i, out in outputs:
                choices[i].add(out)

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                break
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise APIError("client disconnected", 499)
    task.result()  # consume's error, if any
    return choices


class EventStream(StreamingResponse):
    """Server-sent events made from a request's streams, which are closed however the response
    ends: a client gone before the first event leaves the event generator never started, and
    one gone mid-stream may leave it suspended, with its streams still running."""

    def __init__(self, events: AsyncGenerator[str, None], streams: list[Stream]):
        super().__init__(events, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await close(self.streams)

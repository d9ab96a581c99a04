"""Engine streams as the routes read them: a request's n completions started together, read as
one merged stream, collected into choices or sent as server-sent events.

A stream of a request the client has left is aborted, which frees its KV.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request

from jspec.config.sampling import SamplingParams
from jspec.engine.async_engine import AsyncEngine
from jspec.engine.engine import RequestOutput
from jspec.server.errors import APIError
from jspec.server.metrics import ServerMetrics


class Choice:
    """One completion (one prompt x one of n) as it streams: text, tokens, logprobs, finish."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.matched_stop = None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = self.verify_ct = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.top_logprobs += out.new_top_logprobs or []
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        self.cached_tokens, self.verify_ct = out.cached_tokens, out.spec_verify_ct
        if out.finished:
            self.finish_reason, self.matched_stop = out.finish_reason, out.matched_stop


def openai_finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def start(engine: AsyncEngine, ids: list[int], params: SamplingParams, base_index: int):
    """Submits params.n copies (consecutive seeds) and returns their streams, each already past its
    first output, so that a request the engine refuses fails before any response is sent."""
    streams = []
    try:
        for k, p in enumerate(params.completions()):
            agen = engine.stream(ids, p)
            first = await agen.__anext__()
            streams.append((base_index + k, agen, first))
    except (ValueError, RuntimeError) as e:
        for _, agen, _ in streams:
            await agen.aclose()
        status = getattr(e, "status", 400)  # RequestFailed: the server's fault, not the request's
        raise APIError(str(e), status, "server_error" if status >= 500 else "invalid_request_error") from None
    return streams


async def merged(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from every stream as they come; closing it aborts the unfinished ones."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, agen, first):
        try:
            await queue.put((index, first))
            if not first.finished:
                async for out in agen:
                    await queue.put((index, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, e))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(*s)) for s in streams]
    live = len(tasks)
    try:
        while live:
            index, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        for _, agen, _ in streams:
            await agen.aclose()  # aborts a request still running (client gone)


async def observed(metrics: ServerMetrics, items, t0: float):
    """Feeds the metrics from the outputs passing through."""
    last: dict[int, float] = {}
    async for i, out in items:
        now = time.perf_counter()
        if i not in last:
            metrics.ttft.observe(now - t0)
        elif out.new_token_ids:
            per = (now - last[i]) / len(out.new_token_ids)
            for _ in out.new_token_ids:
                metrics.itl.observe(per)
        last[i] = now
        metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            metrics.finished(out.prompt_tokens, out.completion_tokens, out.finish_reason, now - t0,
                             out.spec_verify_ct)
        yield i, out


async def collect(metrics: ServerMetrics, streams, request: Request, t0: float) -> dict[int, Choice]:
    """Runs streams to the end; aborts them if the client disconnects meanwhile."""
    choices = {i: Choice(i) for i, _, _ in streams}

    async def consume():
        async for i, out in observed(metrics, merged(streams), t0):
            choices[i].add(out)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            break
    try:
        await task
    except asyncio.CancelledError:
        raise APIError("client disconnected", 499) from None
    return choices

"""AsyncEngine: the Engine's loop on its own thread, with an async stream per request.

The engine is single-threaded by design (the scheduler and the device state
belong to one loop). Callers on an asyncio event loop (the HTTP server) never
touch it: they submit and abort through a thread-safe inbox, and each request's
outputs come back on an asyncio.Queue fed with call_soon_threadsafe. So a slow
client never blocks the overlap loop, and the loop never waits on a client.

    engine = AsyncEngine(Engine(model))
    async for out in engine.stream([1, 2, 3], SamplingParams(max_new_tokens=8)):
        print(out.new_token_ids, out.new_text)
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable

from jspec.config.sampling import SamplingParams
from jspec.engine.engine import Engine, RequestOutput
from jspec.engine.facts import EngineFacts, EngineStats, engine_stats, serving_facts

log = logging.getLogger("jspec.engine")


class RequestFailed(RuntimeError):
    """The engine could not serve a request for a reason of its own (not the request's)."""

    status = 503


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._batcher = StreamBatcher(engine.config.stream_interval)
        self.thread_id: int | None = None  # the loop thread's native id (benchmarks read its CPU time)
        self._thread = threading.Thread(target=self._run, name="jspec-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any thread / event loop) ------------------------------------------------

    async def stream(
        self, prompt, params: SamplingParams | None = None, rid: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submits a request and yields its outputs until it finishes. Leaving the loop early
        (a client that disconnects) aborts the request and frees its KV."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        added: asyncio.Future = loop.create_future()
        self._check_alive()
        self._inbox.put(("add", prompt, params, rid, loop, outputs, added))
        rid = await added  # raises the engine's validation error, if any
        async with contextlib.aclosing(request_outputs(outputs, lambda: self.abort(rid))) as outs:
            async for out in outs:
                yield out

    def _check_alive(self) -> None:
        if not self.alive:
            raise RequestFailed(f"the engine loop stopped: {self._error!r}")

    @property
    def alive(self) -> bool:
        """The loop thread runs and has not crashed."""
        return self._thread.is_alive() and self._error is None

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    async def call(self, fn, *args):
        """fn(engine, *args) on the engine thread, between steps (the engine is not thread-safe:
        e.g. loading a LoRA adapter rewrites device arrays the next step takes); its result or error."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._check_alive()
        self._inbox.put(("call", fn, args, loop, done))
        return await done

    @functools.cached_property
    def facts(self) -> EngineFacts:
        return serving_facts(self.engine)

    async def stats(self) -> EngineStats:
        return await self.call(engine_stats)

    async def check_grammar(self, params: SamplingParams) -> None:
        """Engine.check_grammar on a worker thread: compiling a grammar never stalls the loop."""
        await asyncio.to_thread(self.engine.check_grammar, params)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the loop: requests still running are aborted, the step in flight is drained."""
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        self.thread_id = threading.get_native_id()
        try:
            while not self._stop.is_set():
                # Block for work only when the engine is idle; otherwise just drain the inbox.
                self._handle(self._inbox.get() if not self.engine.has_work() else None)
                while True:
                    try:
                        self._handle(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if self.engine.has_work():
                    publish_step(self._streams, self._batcher.outputs(self.engine.step()))
        except BaseException as e:  # surface a crash to every waiting client instead of hanging them
            log.exception("the engine loop stopped")
            self._error = e
            for rid in list(self._streams):
                self._publish_error(rid, e)
        finally:
            for rid in list(self._streams):
                try:
                    self.engine.abort(rid)
                finally:
                    self._publish_aborted(rid)
            self._fail_inbox()
            self.engine.drain()

    def _fail_inbox(self) -> None:
        """Answers what was submitted after the loop stopped, so no caller waits for a dead loop."""
        error = RequestFailed(f"the engine loop stopped: {self._error!r}")
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] in ("add", "call"):
                loop, future = (msg[4], msg[6]) if msg[0] == "add" else (msg[3], msg[4])
                loop.call_soon_threadsafe(settle, future, None, error)

    def _handle(self, msg) -> None:
        if msg is None or msg[0] == "wake":
            return
        if msg[0] == "abort":
            if self.engine.abort(msg[1]):
                self._publish_aborted(msg[1])
            return
        if msg[0] == "call":
            _, fn, args, loop, done = msg
            try:
                result = fn(self.engine, *args)
            except Exception as e:
                loop.call_soon_threadsafe(settle, done, None, e)
            else:
                loop.call_soon_threadsafe(settle, done, result, None)
            return
        _, prompt, params, rid, loop, outputs, added = msg
        try:
            rid = self.engine.add_request(prompt, params, rid)
        except Exception as e:
            loop.call_soon_threadsafe(settle, added, None, e)
            return
        self._streams[rid] = (loop, outputs)
        loop.call_soon_threadsafe(settle, added, rid, None)

    def _publish(self, out: RequestOutput) -> None:
        target = self._streams.get(out.rid)
        if target is None:
            return
        if out.finished:
            del self._streams[out.rid]
        loop, outputs = target
        loop.call_soon_threadsafe(outputs.put_nowait, out)

    def _publish_aborted(self, rid: str) -> None:
        """The abort output, after whatever of the request the batcher still held."""
        for out in self._batcher.outputs([RequestOutput(rid, [], "", True, "abort")]):
            self._publish(out)

    def _publish_error(self, rid: str, error: BaseException) -> None:
        loop, outputs = self._streams.pop(rid)
        loop.call_soon_threadsafe(outputs.put_nowait, error)


async def request_outputs(outputs: asyncio.Queue, unfinished: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue until the last; an error queued raises. Left before
    the last (a client that went away, an error), it calls `unfinished`, which aborts the
    request so that its KV is freed.

    Outputs that queued while the reader was busy go out as one: under load the server sends
    fewer, larger chunks instead of falling further behind."""
    finished = False
    try:
        pending = None
        while not finished:
            out, pending = (pending if pending is not None else await outputs.get()), None
            while isinstance(out, RequestOutput) and not out.finished and out.error is None and not outputs.empty():
                later = outputs.get_nowait()
                if isinstance(later, BaseException):
                    pending = later
                    break
                out = out.then(later)
            if isinstance(out, BaseException):
                raise out
            if out.error is not None:
                raise RequestFailed(out.error)
            finished = out.finished
            yield out
    finally:
        if not finished:
            unfinished()


class StreamBatcher:
    """Holds each request's outputs until `interval` new tokens have gathered (SGLang's
    --stream-interval), so that a stream gets one chunk per `interval` tokens instead of one per
    step. A request's first output (its time to first token), its last and an error go out at
    once."""

    def __init__(self, interval: int):
        self.interval = interval
        self.held: dict[str, RequestOutput] = {}
        self.streaming: set[str] = set()  # requests whose first output has gone out

    def outputs(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """The outputs to hand over now, of this step's `outs` and those held before."""
        if self.interval <= 1:
            return outs
        ready = []
        for out in outs:
            held = self.held.pop(out.rid, None)
            if held is not None:
                out = held.then(out)
            if out.finished or out.error is not None:
                self.streaming.discard(out.rid)
                ready.append(out)
            elif out.rid not in self.streaming:
                self.streaming.add(out.rid)
                ready.append(out)
            elif len(out.new_token_ids) >= self.interval:
                ready.append(out)
            else:
                self.held[out.rid] = out
        return ready


def publish_step(streams: dict, outs: Iterable[RequestOutput]) -> None:
    """A step's outputs, handed to each event loop in one callback: one wake-up of the server's
    loop per step, not one per request (at hundreds of running requests those wake-ups cost the
    engine's side more than the step's own host work). streams maps a request id to its (event
    loop, queue); a finished request's entry is dropped."""
    by_loop: dict = {}
    for out in outs:
        target = streams.get(out.rid)
        if target is None:
            continue
        if out.finished:
            streams.pop(out.rid, None)
        by_loop.setdefault(target[0], []).append((target[1], out))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_deliver_outputs, items)


def _deliver_outputs(items: list) -> None:
    """(queue, output) pairs of one step, put on their queues in one event-loop callback."""
    for outputs, out in items:
        outputs.put_nowait(out)


def settle(future: asyncio.Future, value, error) -> None:
    """A caller's future resolved from the engine's side, unless the caller gave up on it."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)

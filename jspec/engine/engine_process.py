"""EngineProcess: the Engine and its overlap loop in a process of their own, behind
AsyncEngine's interface, for `jspec serve`.

Why a process: the HTTP routes spend tens of microseconds of Python per streamed token
(Starlette, server-sent events, JSON). On a thread of the same interpreter that time is taken
from the engine loop under the GIL, and the loop's host time, which must stay below the
device's step, grows with the load. In a process of its own the loop has an interpreter to
itself, as SGLang's scheduler process does.

The child starts by multiprocessing's "spawn" (a process that runs JAX cannot be forked) and
builds the engine itself: the parent never loads weights nor starts a JAX backend, so the
accelerator is the child's alone. One pipe carries pickled messages each way. The child sends
one message per engine step, holding all of that step's outputs, which one reader thread here
hands to each asyncio loop in one callback; the parent's messages (requests, aborts, calls) go
out in batches, whatever queued while the previous batch was written. The child's loop reads
the pipe between steps, without blocking unless it is idle.

    engine = EngineProcess.start(EngineLaunch("/path/to/model", EngineConfig(), LoadConfig()))
    async for out in engine.stream([1, 2, 3], SamplingParams(max_new_tokens=8)):
        print(out.new_token_ids, out.new_text)
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator

from jspec.checkpoint.demo import default_model_path
from jspec.config.engine import EngineConfig
from jspec.config.load import LoadConfig
from jspec.config.sampling import SamplingParams
from jspec.engine.async_engine import RequestFailed, StreamBatcher, publish_step, request_outputs, settle
from jspec.engine.engine import Engine, RequestOutput
from jspec.engine.facts import EngineFacts, EngineStats, engine_stats, serving_facts
from jspec.engine.heap import settle_heap

log = logging.getLogger("jspec.engine")
LOG_FORMAT = "[jspec] %(asctime)s %(levelname)s %(message)s"


class EngineStartError(RuntimeError):
    """The engine process could not build or warm up its engine; the message says why."""


@dataclasses.dataclass(frozen=True)
class EngineLaunch:
    """What the engine process builds: the checkpoint (None: the default demo model), the
    engine's settings, the programs it compiles before serving (None: none, they compile at
    first use) and its logging."""

    model_path: str | None
    config: EngineConfig
    load: LoadConfig
    warmup_sampling_modes: str | None = "all"  # "all", or a comma list of greedy,sampled
    log_level: str = "info"


def warm_up(engine: Engine, modes: str) -> None:
    """Compiles the programs `modes` ("all", or a comma list of sampling modes) needs, logging
    how many and in how long; a ValueError names the flag."""
    t0 = time.perf_counter()
    try:
        n = engine.warmup() if modes == "all" else engine.warmup(modes.split(","))
    except ValueError as e:
        raise ValueError(f"--warmup-sampling-modes: {e}") from None
    logging.getLogger("jspec.serve").info("warm-up: %d programs ready in %.1f s", n, time.perf_counter() - t0)


class EngineProcess:
    """The parent's side: AsyncEngine's interface (stream, abort, call, alive, shutdown) over
    the pipe, plus the engine's facts (sent once, when it is ready) and its stats (asked for)."""

    def __init__(self, launch: EngineLaunch):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=run_engine_process, args=(child_conn, launch), name="jspec-engine", daemon=True
        )
        self._process.start()
        child_conn.close()  # the child's end: the parent holds only its own, so EOF means the child is gone
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._rids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._error: str | None = None
        self.facts: EngineFacts | None = None
        self.model_path: str | None = None  # the checkpoint served (the default model's, if none was named)
        self._reader = threading.Thread(target=self._read, name="jspec-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="jspec-engine-writer", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @classmethod
    def start(cls, launch: EngineLaunch) -> EngineProcess:
        """Starts the engine process and waits until its engine is built and warmed up; raises
        EngineStartError with the child's reason if it fails."""
        engine = cls(launch)
        try:
            msg = engine._conn.recv()
        except EOFError:
            msg = ("failed", None)
        if msg[0] == "failed":
            engine._process.join(30)
            reason = msg[1] or f"the engine process exited with code {engine._process.exitcode} before it was ready"
            engine.shutdown(5)
            raise EngineStartError(reason)
        _, engine.model_path, engine.facts = msg
        engine._reader.start()
        engine._writer.start()
        return engine

    # ---- the interface the routes use -------------------------------------------------------

    async def stream(
        self, prompt, params: SamplingParams | None = None, rid: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submits a request and yields its outputs until it finishes; leaving early aborts it."""
        loop = asyncio.get_running_loop()
        rid = rid if rid is not None else f"req-{next(self._rids)}"
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        # Registered before the request is sent: its first outputs may come right after the reply.
        self._streams[rid] = (loop, outputs)

        def unfinished() -> None:
            self._streams.pop(rid, None)
            self.abort(rid)

        try:
            await self._ask("add", rid, prompt, params)  # raises the engine's validation error, if any
        except BaseException:
            unfinished()
            raise
        async with contextlib.aclosing(request_outputs(outputs, unfinished)) as outs:
            async for out in outs:
                yield out

    def abort(self, rid: str) -> None:
        self._outbox.put(("abort", rid))

    async def call(self, fn, *args):
        """fn(engine, *args) on the engine's loop, between steps; fn and args must pickle (a
        module-level function)."""
        return await self._ask("call", fn, args)

    async def stats(self) -> EngineStats:
        return await self.call(engine_stats)

    async def check_grammar(self, params: SamplingParams) -> None:
        """Engine.check_grammar in the engine process, on a thread beside its loop: the grammar
        compiles into the cache the engine's requests read."""
        await self._ask("check_grammar", params)

    @property
    def alive(self) -> bool:
        """The engine process runs and its loop has not stopped."""
        return self._error is None and self._process.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine process: requests still running are aborted, the step in flight is
        drained; a process that does not stop in time is terminated."""
        if self._process.is_alive():
            self._outbox.put(("shutdown",))
            if not self._writer.is_alive():  # not serving yet: no writer thread
                with contextlib.suppress(OSError):
                    self._conn.send([("shutdown",)])
            self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        if self._reader.is_alive():
            self._reader.join(5)

    # ---- the pipe --------------------------------------------------------------------------

    async def _ask(self, kind: str, *args):
        """Sends a message whose reply the caller awaits: the value, or the error, raised here."""
        loop = asyncio.get_running_loop()
        call_id = next(self._call_ids)
        done: asyncio.Future = loop.create_future()
        # Registered before the check: the reader marks the process dead before it fails the
        # calls it finds, so either this sees the mark or the reader sees this call.
        self._calls[call_id] = (loop, done)
        if not self.alive:
            del self._calls[call_id]
            raise RequestFailed(f"the engine process stopped: {self._error}")
        self._outbox.put((kind, call_id, *args))
        try:
            return await done
        finally:
            self._calls.pop(call_id, None)

    def _write(self) -> None:
        """Sends what queued as one message per batch."""
        while True:
            batch = [self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            try:
                self._conn.send(batch)
            except OSError:
                return
            except Exception:  # a message that does not pickle: the others go alone, its caller fails
                for msg in batch:
                    self._send_alone(msg)
            if batch[-1][0] == "shutdown":
                return

    def _send_alone(self, msg: tuple) -> None:
        try:
            self._conn.send([msg])
        except OSError:
            return
        except Exception as e:
            target = self._calls.get(msg[1]) if msg[0] != "abort" else None
            if target is not None:
                target[0].call_soon_threadsafe(settle, target[1], None, ValueError(f"cannot send {msg[0]}: {e}"))

    def _read(self) -> None:
        """Hands each message of the child to the asyncio loops waiting for it."""
        error = "the engine process exited"
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "step":
                    self._publish(msg[1])
                elif msg[0] == "reply":
                    _, call_id, value, failure = msg
                    target = self._calls.get(call_id)
                    if target is not None:
                        target[0].call_soon_threadsafe(settle, target[1], value, _rebuild(failure))
                elif msg[0] == "stopped":
                    _, reason, aborted = msg
                    self._publish(aborted)
                    error = reason or "the engine process was shut down"
                    return
        except (EOFError, OSError):
            pass
        finally:
            self._fail_all(error)

    def _publish(self, packed: list[tuple]) -> None:
        """One step's outputs, as they crossed the pipe (each a RequestOutput's fields)."""
        publish_step(self._streams, (RequestOutput(*fields) for fields in packed))

    def _fail_all(self, reason: str) -> None:
        """Fails every stream and call still waiting: nothing will answer them."""
        self._error = reason  # first: a caller that registers after the snapshots below sees it
        error = RequestFailed(f"the engine process stopped: {reason}")
        for rid in list(self._streams):
            target = self._streams.pop(rid, None)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, error)
        for call_id in list(self._calls):
            target = self._calls.get(call_id)
            if target is not None:
                target[0].call_soon_threadsafe(settle, target[1], None, error)


# Errors cross the pipe as (kind, text): an exception of the engine's may not pickle back.
_ERROR_KINDS = {"ValueError": ValueError, "TypeError": TypeError}


def _failure(e: BaseException) -> tuple[str, str]:
    kind = next((name for name, cls in _ERROR_KINDS.items() if isinstance(e, cls)), "RuntimeError")
    return kind, str(e) if kind != "RuntimeError" else f"{type(e).__name__}: {e}"


def _rebuild(failure: tuple[str, str] | None) -> BaseException | None:
    if failure is None:
        return None
    kind, text = failure
    return _ERROR_KINDS.get(kind, RuntimeError)(text)


def _pack(out: RequestOutput) -> tuple:
    """A RequestOutput as its fields' values: a tuple pickles several times faster than the
    dataclass."""
    return tuple(out.__dict__.values())


# ---- the child --------------------------------------------------------------------------------


def run_engine_process(conn, launch: EngineLaunch) -> None:
    """The engine process: builds the engine, says it is ready (or why it failed), then runs
    the loop until the parent asks it to stop or goes away."""
    # A terminal's ^C reaches the whole process group: the parent decides when this one stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=launch.log_level.upper(), format=LOG_FORMAT)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU / no GPU" probes are noise
    try:
        path = launch.model_path
        if path is None:
            path, what = default_model_path()
            logging.getLogger("jspec.serve").info("serving %s at %s", what, path)
        engine = Engine(path, launch.config, load=launch.load)
        if launch.warmup_sampling_modes is not None:
            warm_up(engine, launch.warmup_sampling_modes)
        facts = serving_facts(engine)
        settle_heap("engine process", freeze=not launch.config.disable_gc_freeze)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the parent reports it and exits
        if not isinstance(e, (ValueError, NotImplementedError, OSError)):
            log.exception("the engine could not be built")
        with contextlib.suppress(OSError):
            conn.send(("failed", str(e) if isinstance(e, (ValueError, NotImplementedError, OSError)) else repr(e)))
        return
    try:
        conn.send(("ready", path, facts))
    except OSError:
        return  # the parent is gone
    _ChildLoop(engine, conn).run()


class _ChildLoop:
    """The engine's loop in the child: the pipe's messages between steps, one message out per
    step that produced outputs."""

    def __init__(self, engine: Engine, conn):
        self.engine = engine
        self.conn = conn
        self.send_lock = threading.Lock()  # the loop and the grammar thread both reply
        self.grammar_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jspec-grammar")
        self.running = True
        self.rids: set[str] = set()  # requests whose last output is not sent yet
        self.aborted: list[RequestOutput] = []  # abort outputs, sent with the next step's
        self.batcher = StreamBatcher(engine.config.stream_interval)

    def send(self, msg) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def run(self) -> None:
        error = None
        try:
            while self.running:
                # Block for messages only when idle; otherwise take what came and step.
                self.receive(block=not self.engine.has_work())
                if self.running and self.engine.has_work():
                    self.publish(self.engine.step())
                elif self.aborted:
                    self.publish([])
        except (EOFError, OSError):
            log.warning("the server process went away; stopping the engine")
        except BaseException as e:  # surface a crash to every waiting client instead of hanging them
            log.exception("the engine loop stopped")
            error = repr(e)
        finally:
            self.stop(error)

    def receive(self, block: bool) -> None:
        if not block and not self.conn.poll():
            return
        while self.running:
            for msg in self.conn.recv():
                self.handle(msg)
            if not self.conn.poll():
                return

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "abort":
            if self.engine.abort(msg[1]):
                self.aborted.append(RequestOutput(msg[1], [], "", True, "abort"))
        elif kind == "add":
            _, call_id, rid, prompt, params = msg
            if self.reply(call_id, self.engine.add_request, prompt, params, rid):
                self.rids.add(rid)
        elif kind == "call":
            _, call_id, fn, args = msg
            self.reply(call_id, fn, self.engine, *args)
        elif kind == "check_grammar":
            _, call_id, params = msg
            self.grammar_thread.submit(self.reply, call_id, self.engine.check_grammar, params)
        elif kind == "shutdown":
            self.running = False

    def reply(self, call_id: int, fn, *args) -> bool:
        """Sends fn(*args) or its error back; True if it succeeded."""
        try:
            value, failure = fn(*args), None
        except Exception as e:
            value, failure = None, _failure(e)
        try:
            self.send(("reply", call_id, value, failure))
        except OSError:
            raise
        except Exception as e:  # a value that does not pickle
            self.send(("reply", call_id, None, _failure(e)))
        return failure is None

    def publish(self, outputs: list[RequestOutput]) -> None:
        outputs, self.aborted = self.batcher.outputs(self.aborted + outputs), []
        if not outputs:
            return
        for out in outputs:
            if out.finished:
                self.rids.discard(out.rid)
        self.send(("step", [_pack(out) for out in outputs]))

    def stop(self, error: str | None) -> None:
        """Aborts what still runs, drains the step in flight, and tells the parent."""
        self.grammar_thread.shutdown(wait=True, cancel_futures=True)
        aborted = self.aborted
        for rid in self.rids:
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
            aborted.append(RequestOutput(rid, [], "", True, "abort"))
        aborted = self.batcher.outputs(aborted)
        with contextlib.suppress(OSError):
            self.send(("stopped", error, [_pack(out) for out in aborted]))
        self.engine.drain()

"""The prefill side of PD disaggregation: an engine that prefills and hands requests over,
and the server that takes prefill jobs from decode engines.

PrefillEngine runs the ordinary scheduler and steps (chunked prefill, prefix cache, the
overlap loop) but never decodes: as soon as the step holding a prompt's last chunk is
launched it dispatches the read-out of the request's KV and carry from that step's output
state (kv_io.extract_request) and starts their copy to the host; when the step's outputs
are processed, the first token joins them and the request ends here. The decode engine
continues it.

PrefillServer listens on the bootstrap port. Each decode engine holds one connection
(transfer.Link); over it come `prefill` / `abort` messages and back go `kv` (header +
arrays) or `error` messages. One thread runs the engine; each connection has a reader
and a sender thread, so the device->host wait and the wire never stall the engine loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import time

import jax
import numpy as np

from jspec.config.engine import EngineConfig
from jspec.config.sampling import SamplingParams
from jspec.disaggregation import kv_io
from jspec.disaggregation.transfer import Link, LinkClosed, host_id, make_link
from jspec.disaggregation.transfer import dtype as transfer_dtype
from jspec.engine.engine import Engine
from jspec.scheduler.scheduler import Scheduler
from jspec.scheduler.sync import start_host_copy
from jspec.worker.batch import PrefillBatch
from jspec.worker.programs import prefill_jobs

log = logging.getLogger("jspec.pd")
PROTOCOL = 1


class PrefillScheduler(Scheduler):
    """The ordinary scheduler, minus decoding: a prefilled request waits for its handoff."""

    def _schedule_decode(self):
        return None


@dataclasses.dataclass
class Handoff:
    """One prefilled request on its way out: header fields and device arrays (copying to host)."""

    rid: str
    header: dict
    arrays: list  # jax arrays: kv_io.extract_request's, paged ones first
    num_paged: int
    num_tokens: int


def check_disaggregation_args(config: EngineConfig) -> None:
    tp_size = config.tp_size
    if config.speculative is not None and config.speculative.adaptive:
        raise ValueError("adaptive speculation (--speculative-adaptive) is not implemented with PD disaggregation")
    if tp_size != 1:
        raise ValueError(
            f"PD disaggregation with tp_size={tp_size} is not supported yet (a request's KV is "
            f"moved between single-device pools); use tp_size=1"
        )


class PrefillEngine(Engine):
    """Engine(...) whose requests stop after their prefill and come out as Handoffs."""

    grammar_refusal = "PD disaggregation"

    def __init__(self, model, config: EngineConfig | None = None, *, draft=None, **settings):
        config = dataclasses.replace(config or EngineConfig(), **settings)
        check_disaggregation_args(config)
        super().__init__(model, config, draft=draft)
        self.num_paged = len(kv_io.split_state(self.worker.state)[0])
        self.weights = kv_io.weights_fingerprint(self.worker)
        self.handoffs: list[Handoff] = []
        self._reading: dict[str, tuple] = {}  # rid -> (its read-out's device arrays, dispatch time)

    def identity(self) -> dict:
        """What a decode engine must share with this one to take its requests."""
        return {"layout": kv_io.layout(self.worker.state), "weights": self.weights}

    def make_scheduler(self):
        return PrefillScheduler(self.worker, disable_radix_cache=self.config.disable_radix_cache)

    def warmup(self, sampling_modes=None, prompt_logprobs: bool = False) -> int:
        """Compiles the prefill programs and the read-out of every token bucket (this engine never
        decodes, so Engine.warmup's decode programs would be wasted; a prefill samples its first
        token with the same program whatever the sampling). Returns the programs compiled."""
        w = self.worker
        jobs = prefill_jobs(w, False) + (prefill_jobs(w, True) if prompt_logprobs else [])
        return w.programs.compile_all(jobs) + warmup_transfers(w, kv_io.extract_request)

    def add_prefill(self, rid: str, ids: list[int], params: SamplingParams, seed: int) -> str:
        """Queues a prompt whose first token is sampled with the decode engine's params and seed
        (so a sampled request continues as it would in one engine). Stop rules and the output
        budget are the decode engine's: here the request ends after one token."""
        p = dataclasses.replace(params, max_new_tokens=1, stop=[], stop_token_ids=[], ignore_eos=True, n=1, seed=seed)
        return self.add_request(ids, p, rid)

    def on_launched(self, launched) -> None:
        """Dispatches the read-out of every request whose prompt ends in this step, from the step's
        output state: before the next launch can donate that state, and without waiting for the
        step to finish. The copy to the host starts at once; only the first token waits for
        this step's designated read."""
        batch = launched.batch
        if isinstance(batch, PrefillBatch):
            for req, following in zip(batch.reqs, batch.following):
                if following is None:
                    with self.worker.on_mesh():
                        arrays = kv_io.extract_request(
                            self.worker.state, req.pages, self.worker.page_size, len(req.prompt), req.slot
                        )
                    self._reading[req.rid] = (start_host_copy(arrays), time.time())

    def on_processed(self, launched, outputs):
        """A request whose prompt ended in this step leaves as a Handoff."""
        if isinstance(launched.batch, PrefillBatch):
            for req, following in zip(launched.batch.reqs, launched.batch.following):
                if following is not None:
                    continue
                arrays, t_extract = self._reading.pop(req.rid)
                if req.finish_reason == "abort" or not req.output:
                    continue  # aborted while its prefill ran
                self.handoffs.append(self._handoff(req, arrays, t_extract))
                if not req.finished:  # the output budget of 1 ends it; its pages go to the prefix cache
                    req.finish("length")
                    self.scheduler.retire(req)
        return outputs

    def _handoff(self, req, arrays, t_extract: float) -> Handoff:
        n = len(req.prompt)
        lp = req.params.return_logprob
        header = {
            "type": "kv",
            "rid": req.rid,
            "num_tokens": n,
            "first_token": int(req.output[0]),
            "logprob": req.output_logprobs[0] if lp else None,
            "top_logprobs": req.output_top_logprobs[0] if lp and req.output_top_logprobs else None,
            "input_logprobs": req.input_logprobs if req.params.wants_prompt_logprobs else None,
            "input_top_logprobs": req.input_top_logprobs if req.params.wants_prompt_logprobs else None,
            "cached_tokens": req.num_cached_tokens,
            "t_extract": t_extract,
        }
        return Handoff(req.rid, header, arrays, self.num_paged, n)


def warmup_transfers(worker, fn) -> int:
    """Runs fn (kv_io.extract_request or write_request) once per token bucket on the scratch page
    and slot, so no transfer compiles in the serving loop."""
    n, count = kv_io.MIN_TOKENS, 0
    ctx = worker.cfg.max_position_embeddings
    while True:
        pages = [0] * (-(-n // worker.page_size))
        with worker.on_mesh():
            if fn is kv_io.extract_request:
                jax.block_until_ready(fn(worker.state, pages, worker.page_size, n, worker.scratch_slot))
            else:
                want = kv_io.layout(worker.state)
                arrays = [
                    np.zeros((s[0], n, *s[1:]) if kind == "paged" else s, transfer_dtype(dt)) for kind, s, dt in want
                ]
                staged = kv_io.stage_request(want, arrays, n, to_device=True)
                worker.state = fn(worker.state, staged, pages, worker.page_size, n, worker.scratch_slot)
        count += 1
        if n >= ctx:
            return count
        n *= 2


def params_from_wire(d: dict) -> SamplingParams:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
    return SamplingParams(**d)


class _Conn:
    """One decode engine's connection, seen from the prefill server."""

    def __init__(self, cid: int, link: Link):
        self.cid, self.link = cid, link
        self.outbox: queue.Queue = queue.Queue()
        self.alive = True


class PrefillServer:
    """Serves prefill jobs on host:port until stop() (or SIGTERM in serve.py)."""

    def __init__(self, engine: PrefillEngine, host: str = "127.0.0.1", port: int = 8998):
        self.engine = engine
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.addr = f"{host}:{self.listener.getsockname()[1]}"
        self.inbox: queue.Queue = queue.Queue()
        self.conns: dict[int, _Conn] = {}
        self._owner: dict[str, tuple[_Conn, str]] = {}  # engine rid -> (connection, the decode engine's rid)
        self._next_cid = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # ---- connections (reader / sender threads) --------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock, f"{peer[0]}:{peer[1]}"), daemon=True).start()

    def _handshake(self, sock, peer: str) -> None:
        link = make_link(sock, peer, "socket")
        try:
            hello, _ = link.recv()
            if hello.get("type") != "hello" or hello.get("protocol") != PROTOCOL:
                raise LinkClosed(f"{peer} is not a jspec decode engine of protocol {PROTOCOL}: {hello}")
            link = make_link(sock, peer, hello.get("backend", "socket"))
            link.peer_pid = hello.get("pid")
            mine = self.engine.identity()
            problem = None
            if hello.get("layout") != mine["layout"]:
                problem = (
                    "the prefill and decode engines hold different state layouts (model, draft, speculative "
                    "method or dtype differ)"
                )
            elif hello.get("weights") != mine["weights"]:
                problem = "the prefill and decode engines hold different weights (another checkpoint or draft)"
            elif link.backend == "shm" and hello.get("host") != host_id():
                problem = "the shm transfer backend needs both engines on one host; use the socket backend"
            link.send(
                {
                    "type": "hello",
                    "ok": problem is None,
                    "pid": os.getpid(),
                    "protocol": PROTOCOL,
                    "message": problem,
                    **mine,
                }
            )
            if problem is not None:
                raise LinkClosed(f"refused {peer}: {problem}")
        except (LinkClosed, ValueError) as e:
            log.warning("%s", e)
            link.close()
            return
        with self._lock:
            conn = _Conn(self._next_cid, link)
            self._next_cid += 1
            self.conns[conn.cid] = conn
        log.info("decode engine %s connected (%s backend)", peer, link.backend)
        threading.Thread(target=self._send_loop, args=(conn,), daemon=True).start()
        try:
            while True:
                header, _ = link.recv()
                self.inbox.put((conn, header))
        except (LinkClosed, ValueError) as e:
            log.info("decode engine %s: %s", peer, e)
        finally:
            conn.alive = False
            conn.outbox.put(None)
            self.inbox.put((conn, {"type": "lost"}))

    def _send_loop(self, conn: _Conn) -> None:
        while True:
            item = conn.outbox.get()
            if item is None:
                return
            if not conn.alive:
                continue
            try:
                if isinstance(item, Handoff):
                    host = [np.asarray(a) for a in item.arrays]  # waits for the copy started at extraction
                    host = [a[:, : item.num_tokens] if i < item.num_paged else a for i, a in enumerate(host)]
                    conn.link.send(dict(item.header, t_sent=time.time()), host)
                else:
                    conn.link.send(item)
            except LinkClosed as e:
                log.info("%s", e)
                conn.alive = False
            except Exception as e:  # noqa: BLE001 - the decode engine must hear of it, not wait forever
                log.exception("handing over %s failed", getattr(item, "rid", "?"))
                if isinstance(item, Handoff):
                    conn.outbox.put({"type": "error", "rid": item.header["rid"], "message": f"prefill engine: {e}"})

    # ---- the engine thread ----------------------------------------------------------------------

    def _handle(self, conn: _Conn, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "prefill":
            rid = f"{conn.cid}/{msg['rid']}"
            try:
                self.engine.add_prefill(rid, list(msg["ids"]), params_from_wire(msg["params"]), int(msg["seed"]))
            except (ValueError, TypeError, KeyError, RuntimeError) as e:
                conn.outbox.put({"type": "error", "rid": msg.get("rid"), "message": f"prefill engine: {e}"})
                return
            self._owner[rid] = (conn, msg["rid"])
        elif kind == "abort":
            rid = f"{conn.cid}/{msg['rid']}"
            self.engine.abort(rid)
            self._owner.pop(rid, None)
        elif kind == "lost":
            for rid, (c, _) in list(self._owner.items()):
                if c is conn:
                    self.engine.abort(rid)
                    del self._owner[rid]
            self.conns.pop(conn.cid, None)

    def serve_forever(self) -> None:
        threading.Thread(target=self._accept_loop, name="jspec-pd-accept", daemon=True).start()
        log.info("prefill engine listening on %s", self.addr)
        eng = self.engine
        while not self._stop.is_set():
            try:
                item = self.inbox.get(timeout=0.2) if not eng.has_work() else self.inbox.get_nowait()
                self._handle(*item)
                while True:
                    self._handle(*self.inbox.get_nowait())
            except queue.Empty:
                pass
            if eng.has_work():
                eng.step()
            for h in eng.handoffs:
                conn, rid = self._owner.pop(h.rid, (None, None))
                if conn is not None:
                    conn.outbox.put(dataclasses.replace(h, header=dict(h.header, rid=rid)))
            eng.handoffs.clear()
        eng.drain()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.listener.close()
        except OSError:
            pass
        for conn in list(self.conns.values()):
            conn.link.close()

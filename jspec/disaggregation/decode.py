"""The decode side of PD disaggregation: the decode engine and its router to prefill engines.

A request goes to the prefill engine with the fewest outstanding requests; when its KV
arrives, the scheduler streams its first token and, once a slot and pages are free, writes
the arrays in with one jitted, donated step in the loop's launch order, then decodes it.
Arrived requests wait in order (on the device within the staging budget, on the host past
it). A prefill engine that goes away fails the requests it owed; they never held pages.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import threading
import time

from jspec.config.engine import EngineConfig
from jspec.disaggregation import kv_io
from jspec.disaggregation.prefill import PROTOCOL, check_disaggregation_args, warmup_transfers
from jspec.disaggregation.transfer import BACKENDS, Link, LinkClosed, connect, host_id, parse_addr
from jspec.engine.engine import Engine
from jspec.scheduler.request import Request, Status
from jspec.scheduler.scheduler import Scheduler

log = logging.getLogger("jspec.pd")


class PrefillUnavailable(RuntimeError):
    """No prefill engine could take or finish a request: a server-side failure (HTTP 503)."""


@dataclasses.dataclass
class TransferRecord:
    """Timings (time.time(); t_extract and t_sent are the prefill host's clock, so compare them
    with the rest only when both engines share a host) and size of one request's transfer."""

    rid: str
    num_tokens: int
    nbytes: int
    t_submit: float
    t_extract: float  # the prefill engine dispatched the read-out (with the step ending the prompt)
    t_sent: float  # the arrays were on the prefill host and started over the link
    t_received: float
    t_staged: float  # checked, padded (and uploaded, if on_device) by the link's reader thread
    on_device: bool  # uploaded before admission (within the router's stage_bytes)
    t_admitted: float | None = None  # written into this engine's pages


class PrefillRouter:
    """Links to the prefill engines, made on first use and again after a link drops."""

    def __init__(self, addrs: list[str], backend: str, identity: dict, stage_bytes: int = 2 << 30):
        if not addrs:
            raise ValueError("a decode engine needs at least one prefill engine address (HOST:PORT)")
        if backend not in BACKENDS:
            raise ValueError(f"unknown transfer backend {backend!r}; choose from {BACKENDS}")
        for a in addrs:
            parse_addr(a)  # a bad address is refused now, not at the first request
        self.addrs, self.backend, self.identity = list(addrs), backend, identity  # layout and weights
        # Arrived KV is uploaded to the device by the reader thread while at most stage_bytes of it
        # wait there for admission; past that it waits on the host and the loop uploads it.
        self.stage_bytes, self.staged_bytes = stage_bytes, 0
        self._stage_lock = threading.Lock()
        self.links: dict[str, Link] = {}
        self.sent: dict[str, Link] = {}  # rid -> the link that owes its KV
        # (addr, link, header, arrays, t_received); header None: the link died, arrays is the error
        self.inbox: queue.Queue = queue.Queue()

    def _load(self, addr: str) -> tuple:
        link = self.links.get(addr)
        return (link is None, sum(1 for x in self.sent.values() if x is link) if link is not None else 0)

    def submit(self, rid: str, ids: list[int], params: dict, seed: int) -> None:
        """Sends a prefill job to the least-loaded reachable engine; LinkClosed if none is."""
        errors = []
        for addr in sorted(self.addrs, key=self._load):
            link = None
            try:
                link = self._link(addr)
                link.send({"type": "prefill", "rid": rid, "ids": ids, "params": params, "seed": seed})
            except LinkClosed as e:
                errors.append(str(e))
                if link is not None and self.links.get(addr) is link:
                    del self.links[addr]  # its reader reports the loss and what it owed
                continue
            self.sent[rid] = link
            return
        raise LinkClosed("; ".join(errors))

    def abort(self, rid: str) -> None:
        link = self.sent.pop(rid, None)
        if link is not None:
            try:
                link.send({"type": "abort", "rid": rid})
            except LinkClosed:
                pass

    def take(self, rid: str) -> None:
        self.sent.pop(rid, None)

    def lost(self, addr: str, link: Link) -> list[str]:
        """Forgets a dead link; returns the requests it still owed."""
        if self.links.get(addr) is link:
            del self.links[addr]
        link.close()
        link.sweep_orphans()
        owed = sorted(rid for rid, x in self.sent.items() if x is link)
        for rid in owed:
            del self.sent[rid]
        return owed

    def _link(self, addr: str) -> Link:
        link = self.links.get(addr)
        if link is not None:
            return link
        link = connect(addr, self.backend)
        link.send(
            {
                "type": "hello",
                "protocol": PROTOCOL,
                "backend": self.backend,
                "pid": os.getpid(),
                "host": host_id(),
                **self.identity,
            }
        )
        link.sock.settimeout(60)
        try:
            hello, _ = link.recv()
        finally:
            link.sock.settimeout(None)
        if not hello.get("ok"):
            link.close()
            raise LinkClosed(f"prefill engine at {addr} refused this decode engine: {hello.get('message')}")
        link.peer_pid = hello.get("pid")
        self.links[addr] = link
        threading.Thread(target=self._read_loop, args=(addr, link), name=f"jspec-pd-{addr}", daemon=True).start()
        return link

    def _read_loop(self, addr: str, link: Link) -> None:
        try:
            while True:
                header, arrays = link.recv()
                t_received = time.time()
                if header.get("type") == "kv":
                    header, arrays = self._stage(addr, header, arrays)
                self.inbox.put((addr, link, header, arrays, t_received))
        except Exception as e:  # noqa: BLE001 - whatever ends the reader fails what the link owed
            self.inbox.put((addr, link, None, e, time.time()))

    def _stage(self, addr: str, header: dict, arrays) -> tuple[dict, list]:
        nbytes = sum(a.nbytes for a in arrays)
        with self._stage_lock:
            on_device = self.staged_bytes + nbytes <= self.stage_bytes
            self.staged_bytes += nbytes if on_device else 0
        try:
            arrays = kv_io.stage_request(self.identity["layout"], arrays, int(header["num_tokens"]), on_device)
        except (ValueError, KeyError) as e:
            self.unstage(nbytes if on_device else 0)
            return {
                "type": "error",
                "rid": header.get("rid"),
                "message": f"the prefill engine at {addr} sent an unusable transfer: {e}",
            }, []
        return dict(header, staged_bytes=nbytes if on_device else 0, t_staged=time.time()), arrays

    def unstage(self, nbytes: int) -> None:
        with self._stage_lock:
            self.staged_bytes -= nbytes

    def wait(self, timeout: float) -> None:
        """Blocks until something arrives (it is put back) or timeout."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        self.inbox.put(item)

    def close(self) -> None:
        for link in list(self.links.values()):
            link.close()
        self.links.clear()


class DecodeScheduler(Scheduler):
    """The ordinary scheduler, whose new requests get their prompt's KV from a prefill engine."""

    def __init__(self, worker, *, router: PrefillRouter, make_output, **kw):
        super().__init__(worker, **kw)
        self.router = router
        self._make_output = make_output  # Engine.output: a RequestOutput from a snapshot
        self.awaiting: dict[str, tuple[Request, float]] = {}  # rid -> (req, submit time)
        # (req, n, arrays, record, bytes staged on the device): arrived, waiting for a slot and pages
        self.arrived: collections.deque = collections.deque()
        self.outputs: list = []  # first tokens and failures, for the engine's next step()
        self.transfers: list[TransferRecord] = []
        self.max_queued = 0  # most arrived requests that waited for room at once
        self.errors: dict[str, str] = {}  # rid -> why it failed (Engine.generate raises them)
        self.deferred: list[tuple[Request, str]] = []  # failed in add(): (req, why)

    def add(self, req: Request) -> None:
        super().add(req)  # the pool-size check and bookkeeping; then it waits on a prefill engine instead
        self.waiting.remove(req)
        wire = dataclasses.asdict(req.params)
        t = time.time()
        self._take_arrivals()  # a link that died while this engine idled is dropped now, not used
        self.awaiting[req.rid] = (req, t)
        try:
            self.router.submit(req.rid, list(req.prompt), wire, req.seed)
        except LinkClosed as e:
            # Reported by the next step: the caller (Engine.generate) still finds the request now.
            self.deferred.append((req, f"no prefill engine could take the request: {e}"))

    def abort(self, rid: str) -> bool:
        if rid in self.awaiting:
            req, _ = self.awaiting.pop(rid)
            self.router.abort(rid)
            req.finish("abort")
            self.retire(req)
            return True
        for item in self.arrived:
            if item[0].rid == rid:
                self.arrived.remove(item)
                self.router.unstage(item[4])
                item[0].finish("abort")
                self.retire(item[0])
                return True
        return super().abort(rid)

    def has_work(self) -> bool:
        return super().has_work() or bool(self.awaiting or self.arrived or self.outputs or self.deferred)

    def schedule(self):
        for req, error in self.deferred:
            if not req.finished:  # else aborted meanwhile
                self._fail(req, error)
        self.deferred = []
        self._take_arrivals()
        self._admit_arrived()
        batch = super().schedule()
        if batch is None and self.awaiting and not (self.arrived or self.outputs or super().has_work()):
            self.router.wait(0.01)  # nothing to run until a prefill engine answers: do not spin
        return batch

    def _fail(self, req: Request, message: str) -> None:
        self.awaiting.pop(req.rid, None)
        before = (len(req.output), len(req.text), len(req.output_logprobs), len(req.output_top_logprobs))
        req.finish("abort")
        self.retire(req)
        self.errors[req.rid] = message
        self.outputs.append(dataclasses.replace(self._make_output(req, *before), error=message))

    def _take_arrivals(self) -> None:
        while True:
            try:
                addr, link, header, arrays, t_recv = self.router.inbox.get_nowait()
            except queue.Empty:
                return
            if header is None:  # the link died: everything it owed fails
                owed = self.router.lost(addr, link)
                log.warning(
                    "link to the prefill engine at %s lost (%s); failing the %d requests it owed",
                    addr,
                    arrays,
                    len(owed),
                )
                for rid in owed:
                    if rid in self.awaiting:
                        self._fail(
                            self.awaiting[rid][0],
                            f"the prefill engine at {addr} went away before this request's KV arrived ({arrays})",
                        )
                continue
            rid = header.get("rid")
            self.router.take(rid)
            if rid not in self.awaiting:
                self.router.unstage(header.get("staged_bytes", 0))
                continue  # aborted meanwhile
            req, t_submit = self.awaiting[rid]
            if header.get("type") == "error":
                self._fail(req, header.get("message") or "prefill failed")
                continue
            n, staged = int(header["num_tokens"]), header["staged_bytes"]
            if n != len(req.prompt):
                self.router.unstage(staged)
                self._fail(
                    req, f"the prefill engine at {addr} sent the KV of {n} tokens for a prompt of {len(req.prompt)}"
                )
                continue
            del self.awaiting[rid]
            rec = TransferRecord(
                rid,
                n,
                sum(a.nbytes for a in arrays),
                t_submit,
                header["t_extract"],
                header["t_sent"],
                t_recv,
                header["t_staged"],
                staged > 0,
            )
            self.transfers.append(rec)
            self._first_token(req, header)
            if req.finished:
                self.router.unstage(staged)
                self.retire(req)
                continue
            self.arrived.append((req, n, arrays, rec, staged))

    def _first_token(self, req: Request, header: dict) -> None:
        before = (len(req.output), len(req.text), len(req.output_logprobs), len(req.output_top_logprobs))
        top = header.get("top_logprobs")
        top_ids = [[t for t, _ in top]] if top else None
        top_lp = [[v for _, v in top]] if top else None
        lp = header.get("logprob")
        req.append([header["first_token"]], [lp] if lp is not None else None, top_ids, top_lp)
        if header.get("input_logprobs") is not None:
            req.input_logprobs = header["input_logprobs"]
            req.input_top_logprobs = [
                [tuple(x) for x in row] if row is not None else None for row in header["input_top_logprobs"]
            ]
        req.num_cached_tokens = header.get("cached_tokens", 0)
        self.outputs.append(self._make_output(req, *before))

    def _admit_arrived(self) -> None:
        w = self.worker
        # Room kept for the running requests' next iteration, so an admission never forces a retraction.
        reserve = len(self.running) * self.pages_for(w.max_emit + w.kv_margin)
        while self.arrived:
            req, n, arrays, rec, staged = self.arrived[0]
            need = self.pages_for(n + w.kv_margin)
            self._evict_for(need + reserve)
            if not self.kv.free_slots or need + reserve > self.kv.allocator.num_free:
                break
            self.arrived.popleft()
            req.slot = self.kv.alloc_slot()
            req.pages = self.kv.allocator.alloc(need)
            with w.on_mesh():
                w.state = kv_io.write_request(w.state, arrays, req.pages, self.page_size, n, req.slot)
            self.router.unstage(staged)  # the write owns the device copy now; it is freed with the step
            req.prefill_ids, req.prefilled, req.kv_len = list(req.prompt), n, n
            req.status = Status.RUNNING
            self.running.append(req)
            rec.t_admitted = time.time()
        self.max_queued = max(self.max_queued, len(self.arrived))


class DecodeEngine(Engine):
    """Engine(...) whose prompts are prefilled by the prefill engines at prefill_addrs."""

    grammar_refusal = "PD disaggregation"

    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        *,
        draft=None,
        prefill_addrs: list[str],
        transfer_backend: str = "socket",
        transfer_stage_bytes: int = 2 << 30,
        **settings,
    ):
        config = dataclasses.replace(config or EngineConfig(), **settings)
        check_disaggregation_args(config)
        self._router_args = (prefill_addrs, transfer_backend, transfer_stage_bytes)
        super().__init__(model, config, draft=draft)

    def make_scheduler(self):
        addrs, backend, stage_bytes = self._router_args
        self.router = PrefillRouter(
            addrs,
            backend,
            {"layout": kv_io.layout(self.worker.state), "weights": kv_io.weights_fingerprint(self.worker)},
            stage_bytes,
        )
        return DecodeScheduler(
            self.worker,
            router=self.router,
            make_output=self.output,
            disable_radix_cache=self.config.disable_radix_cache,
        )

    def warmup(self, sampling_modes=None, prompt_logprobs: bool = False) -> int:
        """Engine.warmup (decode programs; the prefill ones serve retracted requests) plus the
        KV write of every token bucket."""
        return super().warmup(sampling_modes, prompt_logprobs) + warmup_transfers(self.worker, kv_io.write_request)

    def check_idle_no_leaks(self) -> None:
        super().check_idle_no_leaks()
        if self.router.staged_bytes:
            raise AssertionError(f"{self.router.staged_bytes} bytes of transferred KV still counted as staged")

    def step(self):
        outs = self.scheduler.outputs
        outs += super().step()
        self.scheduler.outputs = []
        return outs

    def generate(self, prompts, params=None):
        """As Engine.generate; requests the prefill side failed raise PrefillUnavailable."""
        self.scheduler.errors.clear()
        results = super().generate(prompts, params)
        if self.scheduler.errors:
            errors, self.scheduler.errors = self.scheduler.errors, {}
            raise PrefillUnavailable("; ".join(f"{rid}: {e}" for rid, e in sorted(errors.items())))
        return results

    def close(self) -> None:
        self.drain()
        self.router.close()

"""DP attention, the host side of scheduling: one Scheduler per DP rank, in lockstep.

As SGLang's DP controller, new requests go to a rank (round robin, or the rank with
the fewest requests: --load-balance-method round_robin / shortest_queue) and stay
there: its pages, slot and prefix cache are that rank's. Each iteration is one
dispatch for all ranks, so all run the same kind of step: if any rank has a prefill
chunk to run, the iteration is a prefill and the other ranks idle in it (as one
rank's decodes already wait for its own prefills); otherwise every rank with running
requests decodes and the rest idle. A rank's sub-batch is exactly what its own
Scheduler built, so everything per request (over-allocation, the one-step lag,
retraction) is the one-device code.
"""

from __future__ import annotations

import collections
import itertools

import jax

from jspec.config.engine import LOAD_BALANCE_METHODS
from jspec.kvcache.radix_cache import RadixCache
from jspec.scheduler.scheduler import Scheduler
from jspec.worker.batch import DPBatch, PrefillBatch


class RankCaches:
    """The ranks' prefix caches, for the engine's idle leak check and the server's counters."""

    def __init__(self, caches: list[RadixCache]):
        self.caches = caches

    def check_invariants(self) -> None:
        for c in self.caches:
            c.check_invariants()

    def reset(self) -> int:
        return sum(c.reset() for c in self.caches)

    def cached_pages(self) -> int:
        return sum(c.cached_pages() for c in self.caches)


class DPScheduler:
    mixed_chunk = False  # a DP batch's prefills run alone on every rank

    def __init__(self, worker, *, disable_radix_cache: bool = False, load_balance_method: str = "round_robin"):
        if load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"unknown load_balance_method {load_balance_method!r}; choose one of {LOAD_BALANCE_METHODS}"
            )
        self.load_balance_method = load_balance_method
        self.chunked_prefill_size = worker.chunked_prefill_size  # per rank
        # Each rank's Scheduler keeps its own pages, slots and prefix cache, with local ids.
        self.ranks = [Scheduler(worker, disable_radix_cache=disable_radix_cache) for _ in range(worker.dp)]
        self.prefix_cache = None if disable_radix_cache else RankCaches([s.prefix_cache for s in self.ranks])
        self._next = itertools.cycle(range(len(self.ranks)))

    @property
    def max_request_tokens(self) -> int:
        """What one request may hold: a rank's pool's room (a request lives on one rank)."""
        return min(s.max_request_tokens for s in self.ranks)

    def usage(self) -> dict[str, int]:
        per_rank = [s.usage() for s in self.ranks]
        return {k: sum(u[k] for u in per_rank) for k in per_rank[0]}

    def check_no_leaks(self) -> None:
        for i, s in enumerate(self.ranks):
            try:
                s.check_no_leaks()
            except AssertionError as e:
                raise AssertionError(f"DP rank {i}: {e}") from None

    # ---- requests -------------------------------------------------------------------------------

    @property
    def requests(self) -> collections.ChainMap:
        return collections.ChainMap(*(s.requests for s in self.ranks))

    def pick_rank(self) -> int:
        if self.load_balance_method == "round_robin":
            return next(self._next)
        load = [len(s.waiting) + len(s.prefilling) + len(s.running) for s in self.ranks]
        return load.index(min(load))

    def add(self, req) -> int:
        """Queues req on a rank; returns the rank."""
        rank = self.pick_rank()
        self.ranks[rank].add(req)
        return rank

    def abort(self, rid: str) -> bool:
        for s in self.ranks:
            if rid in s.requests:
                return s.abort(rid)
        return False

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.ranks)

    def rank_of(self, rid: str) -> int | None:
        return next((i for i, s in enumerate(self.ranks) if rid in s.requests), None)

    # Aggregates for /metrics and /debug/state.
    waiting = property(lambda self: [r for s in self.ranks for r in s.waiting])
    prefilling = property(lambda self: [r for s in self.ranks for r in s.prefilling])
    running = property(lambda self: [r for s in self.ranks for r in s.running])
    prefilled_tokens = property(lambda self: sum(s.prefilled_tokens for s in self.ranks))
    num_retractions = property(lambda self: sum(s.num_retractions for s in self.ranks))

    # ---- scheduling -------------------------------------------------------------------------------

    def schedule(self) -> DPBatch | None:
        # A rank's own prefill-first choice, made for all ranks at once: the kinds cannot mix in
        # one dispatch, and a decode batch once built must run (it counts its launch in flight).
        prefills = [s._schedule_prefill() for s in self.ranks]
        if any(b is not None for b in prefills):
            return DPBatch(prefills)
        decodes = [s._schedule_decode() for s in self.ranks]
        if any(b is not None for b in decodes):
            return DPBatch(decodes)
        return None

    def on_decode_done(self, batch: DPBatch, out, speculative: bool) -> list:
        """out: the StepOutput of all ranks on the host, each leaf [dp, ...]. The engine hands a
        DPBatch here whatever its kind (it is neither a PrefillBatch nor a DecodeBatch); each
        sub-batch goes to its rank's Scheduler by its own kind."""
        touched = []
        for rank, (s, b) in enumerate(zip(self.ranks, batch.per_rank)):
            if b is None:
                continue
            mine = jax.tree.map(lambda a, r=rank: a[r], out)
            if isinstance(b, PrefillBatch):
                touched += s.on_prefill_done(b, mine)
            else:
                touched += s.on_decode_done(b, mine, speculative)
        return touched

    def on_prefill_done(self, batch: DPBatch, out) -> list:
        return self.on_decode_done(batch, out, False)

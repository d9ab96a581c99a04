"""The scheduler: which requests run next, and the KV pages and slots they hold.

It works from what the host knows: under the overlap loop it builds batch N+1 before reading
batch N, so a request's pages cover kv_len + in-flight decodes * max_emit + kv_margin
positions (over-allocation). The one-step-lag rule lives in `on_decode_done`. Policy, as
SGLang's default: prefills first (chunked), else decode every running request; short of
pages, evict the prefix cache, then retract the most recently admitted request.
"""

from __future__ import annotations

import collections

import numpy as np

from jspec.constrained.grammar import allow_all, row_masks
from jspec.kvcache.allocator import OutOfPagesError
from jspec.kvcache.radix_cache import RadixCache
from jspec.scheduler.kv_manager import KVManager
from jspec.scheduler.request import Request, Status
from jspec.worker.batch import DecodeBatch, PrefillBatch
from jspec.worker.inputs import SeqChunk
from jspec.worker.programs import StepCosts


def cache_key(req: Request, tokens: list[int]) -> list[int]:
    """The prefix-cache key of req's tokens. KV computed under a LoRA adapter is that adapter's
    alone, so its tokens are keyed in the adapter's own namespace (ids moved past every real
    token id), where only requests of the same loaded adapter find them; SGLang's radix cache
    keys LoRA requests the same way (by adapter id)."""
    ns = req.cache_namespace
    return tokens if not ns else [t + (ns << 32) for t in tokens]


class Scheduler:
    def __init__(self, worker, *, disable_radix_cache: bool = False, mixed_chunk: bool = False):
        self.worker = worker
        # Prefills carry the running requests' decode rows (the worker reads their tokens from the
        # device carry), so new prompts never stall the running ones for a step.
        self.mixed_chunk = mixed_chunk
        # With step costs (timed at warm-up), a mixed step's tokens are cut so that it costs at
        # most mixed_slowdown times its decode rows' own step: their inter-token latency.
        self.step_costs: StepCosts | None = None
        self.mixed_slowdown = 0.0
        self.page_size = worker.page_size
        self.chunked_prefill_size = worker.chunked_prefill_size
        self.kv = KVManager(worker.num_pages, worker.max_slots, worker.page_size)
        self.prefix_cache = None if disable_radix_cache else RadixCache(self.kv.allocator, worker.page_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.prefilled_tokens = 0  # tokens actually run through prefill (prefix-cache hits excluded)
        self.num_retractions = 0

    # ---- requests in and out -------------------------------------------------------------

    def pages_for(self, tokens: int) -> int:
        return self.kv.pages_for(tokens)

    @property
    def max_request_tokens(self) -> int:
        """The most prompt + new tokens one request may ask for: what the whole pool holds,
        less the positions a decode may write past a request's end."""
        return self.kv.allocator.num_usable * self.page_size - self.worker.kv_margin - self.worker.max_emit

    def add(self, req: Request) -> None:
        if len(req.prompt) + req.params.max_new_tokens > self.max_request_tokens:
            worst = len(req.prompt) + req.params.max_new_tokens + self.worker.kv_margin + self.worker.max_emit
            raise OutOfPagesError(
                f"request {req.rid} needs up to {self.pages_for(worst)} KV pages ({len(req.prompt)} prompt + "
                f"{req.params.max_new_tokens} new tokens at page size {self.page_size}); the pool has "
                f"{self.kv.allocator.num_usable}"
            )
        req.prefill_ids = list(req.prompt)
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        req.finish("abort")
        self.retire(req)
        return True

    def usage(self) -> dict[str, int]:
        """KV pages and request slots, for /metrics and /debug/state."""
        a = self.kv.allocator
        return {
            "kv_pages_total": a.num_usable,
            "kv_pages_free": a.num_free,
            "kv_pages_cached": self.prefix_cache.cached_pages() if self.prefix_cache is not None else 0,
            "request_slots_total": self.kv.max_slots,
            "request_slots_free": len(self.kv.free_slots),
        }

    def check_no_leaks(self) -> None:
        """At idle, with the prefix cache emptied, every page and slot is back."""
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()
            self.prefix_cache.reset()  # cached prefixes hold pages by design; drop them to count
        self.kv.check_no_leaks()

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def retire(self, req: Request) -> None:
        """Releases what a finished request holds and forgets it."""
        self._release(req, keep_kv=req.finish_reason != "abort")
        for queue in (self.prefilling, self.running):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.rid, None)

    def _release(self, req: Request, keep_kv: bool = True) -> None:
        """Returns req's pages and slot. With a prefix cache, its full pages of valid KV
        (positions < kv_len) are offered to the cache first (RadixCache's protocol: insert,
        then free own pages, then unlock the match)."""
        cache = self.prefix_cache
        if cache is not None and keep_kv and req.pages and req.kv_len > 0:
            cache.insert(cache_key(req, (req.prompt + req.output)[: req.kv_len]), req.pages)
        self.kv.allocator.free(req.pages[req.num_shared_pages :])
        req.pages, req.num_shared_pages = [], 0
        if req.cached_prefix is not None:
            cache.unlock(req.cached_prefix)
            req.cached_prefix = None
        if req.slot is not None:
            self.kv.free_slot(req.slot)
            req.slot = None

    # ---- scheduling -----------------------------------------------------------------------

    def schedule(self) -> PrefillBatch | DecodeBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _grow(self, req: Request, tokens: int) -> bool:
        """Ensures req's pages cover `tokens` positions; False if the pool cannot."""
        need = self.pages_for(tokens) - len(req.pages)
        if need <= 0:
            return True
        self._evict_for(need)
        if need > self.kv.allocator.num_free:
            return False
        req.pages.extend(self.kv.allocator.alloc(need))
        return True

    def _schedule_prefill(self) -> PrefillBatch | None:
        decode_rows = self._mixable_running() if self.mixed_chunk else []
        if len(decode_rows) >= self.chunked_prefill_size:
            decode_rows = []  # they would fill the step: the prompts get one step alone, as unmixed
        # The decode rows take their share of the step's tokens first: a step's cost follows its
        # token count, and the running requests' latency is what mixing protects.
        budget = self.chunked_prefill_size - len(decode_rows)
        if decode_rows and self.step_costs is not None:
            budget = min(
                budget, self.step_costs.mixed_step_tokens(len(decode_rows), self.mixed_slowdown) - len(decode_rows)
            )
        batch = PrefillBatch()
        # Requests mid-prefill first, then new (or retracted) ones in arrival order.
        candidates = list(self.prefilling)
        planned = sum(len(r.prefill_ids) - r.prefilled for r in candidates)
        for req in list(self.waiting):
            if planned >= budget:
                break
            if req.inflight_outputs:
                continue  # a retracted request whose last outputs are still in flight
            if req.params.wants_prompt_logprobs and not self.worker.prompt_logprob_programs_ready():
                continue  # its prefill program compiles in the background; the others go on
            if req.grammar is not None and not self.worker.grammar_programs_ready():
                continue  # likewise the masked programs
            if not self.kv.free_slots:
                break
            if not self._admit(req):
                break
            candidates.append(req)
            planned += len(req.prefill_ids) - req.prefilled
        for req in candidates:
            left = budget - sum(len(c.tokens) for c in batch.chunks)
            if left <= 0:
                break
            n = min(len(req.prefill_ids) - req.prefilled, left)
            end = req.prefilled + n
            if not self._grow(req, end + (self.worker.kv_margin if end == len(req.prefill_ids) else 0)):
                break
            batch.reqs.append(req)
            batch.chunks.append(SeqChunk(req.prefill_ids[req.prefilled : end], req.prefilled, req.pages))
            batch.following.append(req.prefill_ids[end] if end < len(req.prefill_ids) else None)
            batch.slots.append(req.slot)
            batch.output_starts.append(len(req.prompt))
            batch.first_chunks.append(req.prefilled == req.num_cached_tokens)
            batch.sampling.append((req.params, req.seed))
            batch.loras.append(req.lora_slot)
        if not batch.chunks:
            return None
        batch.vocab_masks = self._vocab_masks(batch.reqs, [f is None for f in batch.following])
        batch.decode_rows = [False] * len(batch.chunks)
        for req, chunk, following in zip(batch.reqs, batch.chunks, batch.following):
            req.prefilled += len(chunk.tokens)
            self.prefilled_tokens += len(chunk.tokens)
            req.inflight_outputs += 1
            if following is None:
                # The last chunk is launched: the request decodes from the next batch on, reading
                # its first token from the device carry (it is not on the host yet).
                req.status = Status.RUNNING
                req.kv_len = len(req.prefill_ids)
                if req in self.prefilling:
                    self.prefilling.remove(req)
                self.running.append(req)
        if decode_rows and self._add_decode_rows(batch, decode_rows):
            if batch.vocab_masks is not None:
                batch.vocab_masks = np.concatenate(
                    [batch.vocab_masks, allow_all(len(decode_rows), self.worker.vocab_size)]
                )
        return batch

    def _mixable_running(self) -> list[Request]:
        """The running requests a prefill can carry as decode rows: all of them, unless one has
        a grammar (its mask follows from a token still in flight: it decodes in a decode step,
        whose launch waits for that token)."""
        running = [r for r in self.running if r.status is Status.RUNNING]
        if any(r.grammar is not None for r in running):
            return []
        return sorted(running, key=lambda r: r.arrival)

    def _add_decode_rows(self, batch: PrefillBatch, reqs: list[Request]) -> bool:
        """Appends reqs to batch as one-token rows at their next position (plain decoding emits
        one token a step, so that is kv_len + in-flight decodes); False, adding none, when the
        pool cannot grow them all (the next decode step retracts)."""
        w = self.worker
        for req in reqs:
            if not self._grow(req, req.kv_len + req.inflight * w.max_emit + w.kv_margin):
                return False
        for req in reqs:
            batch.reqs.append(req)
            batch.chunks.append(SeqChunk([0], req.kv_len + req.inflight, req.pages))
            batch.following.append(None)
            batch.slots.append(req.slot)
            batch.output_starts.append(len(req.prompt))
            batch.first_chunks.append(False)
            batch.sampling.append((req.params, req.seed))
            batch.loras.append(req.lora_slot)
            batch.decode_rows.append(True)
            req.inflight += 1
            req.inflight_outputs += 1
        return True

    def _admit(self, req: Request) -> bool:
        """Moves a waiting request to prefilling if a slot and its whole prompt's pages are free."""
        req.prefill_ids = req.prompt + req.output
        req.prefilled = 0
        if self.prefix_cache is not None:
            # Keep at least one token to prefill: its logits give the next token. With a
            # draft model, the draft KV at the last cached position pairs it with the token
            # that followed in the request that wrote it; when this request's next token
            # differs, that one draft entry is stale, which can only lower acceptance.
            # Penalties count every prompt (and re-prefilled output) token on the device as the
            # prefill runs over it, and prompt logprobs come from the prefill's logits, so such
            # requests prefill all of their tokens themselves.
            own = req.params.has_penalties or req.params.wants_prompt_logprobs
            m = self.prefix_cache.match_prefix(cache_key(req, req.prefill_ids[:-1] if not own else []))
            self.prefix_cache.lock(m)
            req.cached_prefix, req.pages, req.num_shared_pages = m, list(m.pages), len(m.pages)
            req.prefilled = m.num_tokens
        need = self.pages_for(len(req.prefill_ids) + self.worker.kv_margin) - len(req.pages)
        self._evict_for(need)
        if need > self.kv.allocator.num_free:
            self._release(req, keep_kv=False)
            req.prefilled = 0
            return False
        req.num_cached_tokens = req.prefilled
        self.waiting.remove(req)
        req.slot = self.kv.alloc_slot()
        req.status = Status.PREFILLING
        self.prefilling.append(req)
        return True

    def _evict_for(self, need: int) -> None:
        short = need - self.kv.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)

    def _schedule_decode(self) -> DecodeBatch | None:
        w = self.worker
        batch = DecodeBatch()
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING:
                continue  # retracted earlier in this loop to make room
            bound = req.kv_len + req.inflight * w.max_emit + w.kv_margin
            while not self._grow(req, bound):
                victim = self._pick_victim(exclude=req)
                if victim is None:
                    raise OutOfPagesError(
                        f"KV pool too small: request {req.rid} alone needs {self.pages_for(bound)} pages, "
                        f"{self.kv.allocator.num_usable} exist"
                    )
                self._retract(victim)
                if victim in batch.reqs:
                    i = batch.reqs.index(victim)
                    for col in (batch.reqs, batch.slots, batch.page_tables, batch.sampling, batch.loras):
                        col.pop(i)
            batch.reqs.append(req)
            batch.slots.append(req.slot)
            batch.page_tables.append(list(req.pages))
            batch.sampling.append((req.params, req.seed))
            batch.loras.append(req.lora_slot)
        if not batch.reqs:
            return None
        if any(r.grammar is not None for r in batch.reqs):
            # Masks follow from the tokens still in flight: the worker computes them when the
            # engine has processed the previous step (a deferred launch, docs/architecture.md).
            batch.grammars = [r.grammar for r in batch.reqs]
        for req in batch.reqs:
            req.inflight += 1
            req.inflight_outputs += 1
        return batch

    def _vocab_masks(self, reqs: list[Request], samples: list[bool]):
        """A prefill's token bitmasks [rows, words] (int32), from the grammar state of each
        constrained request whose prompt ends here (nothing of it is in flight); None when no
        such row has a grammar (the step then runs its unmasked program)."""
        grammars = [r.grammar if s else None for r, s in zip(reqs, samples)]
        if all(g is None for g in grammars):
            return None
        return row_masks(grammars, self.worker.vocab_size)

    def _pick_victim(self, exclude: Request) -> Request | None:
        others = [r for r in self.running if r is not exclude]
        return max(others, key=lambda r: r.arrival) if others else None

    def _retract(self, req: Request) -> None:
        self.num_retractions += 1
        req.retractions += 1
        # Its valid KV goes to the prefix cache (if any), so re-admission may find it there.
        self._release(req)
        req.status = Status.WAITING
        req.inflight = 0  # its in-flight outputs are still processed (they are valid tokens)
        self.running.remove(req)
        self.waiting.appendleft(req)

    # ---- results --------------------------------------------------------------------------

    def on_prefill_done(self, batch: PrefillBatch, out) -> list[Request]:
        """out: the prefill's StepOutput on the host (one token per row)."""
        touched = []
        offset = 0  # chunks sit back to back in the batch's token axis
        tokens, accept = (out.tokens.tolist(), out.accept_len.tolist()) if batch.decode_rows else ((), ())
        for i, (req, following) in enumerate(zip(batch.reqs, batch.following)):
            chunk = batch.chunks[i]
            if batch.decode_rows and batch.decode_rows[i]:
                offset += 1
                if self._on_decode_row(req, out, i, tokens[i][: accept[i] + 1], speculative=False):
                    touched.append(req)
                continue
            if out.prompt is not None and req.params.wants_prompt_logprobs and not req.finished:
                n = len(chunk.tokens)
                p = out.prompt
                req.record_prompt_logprobs(
                    chunk.start,
                    p.logprobs[offset : offset + n],
                    p.top_ids[offset : offset + n],
                    p.top_logprobs[offset : offset + n],
                )
            offset += len(chunk.tokens)
            req.inflight_outputs -= 1
            if following is None and self._failed(req):
                touched.append(req)
            elif following is None and not req.finished:
                req.append(out.tokens[i, :1], out.logprobs[i], out.top_ids[i], out.top_logprobs[i])
                touched.append(req)
                if req.finished:
                    self.retire(req)
        return touched

    def _failed(self, req: Request) -> bool:
        """Ends a request that failed while its step ran (its error says why)."""
        if req.error is None and req.grammar is not None:
            req.error = req.grammar.failure
        if req.error is None or req.finished:
            return False
        req.finish("abort")
        self.retire(req)
        return True

    def on_decode_done(self, batch: DecodeBatch, out, speculative: bool) -> list[Request]:
        """out: the decode's StepOutput on the host."""
        # Python lists once per step: per-row numpy indexing was most of a row's bookkeeping.
        tokens, accept = out.tokens.tolist(), out.accept_len.tolist()
        return [
            req
            for i, req in enumerate(batch.reqs)
            if self._on_decode_row(req, out, i, tokens[i][: accept[i] + 1], speculative)
        ]

    def _on_decode_row(self, req: Request, out, i: int, emitted: list[int], speculative: bool) -> bool:
        """Row i of a step's output is req's decode, which emitted these tokens: they are
        appended. Returns whether req has news for its caller."""
        req.inflight_outputs -= 1
        if req.finished:
            return False  # one-step lag: launched before its finish was seen; drop these tokens
        if self._failed(req):
            return True
        if req.status is Status.RUNNING:
            req.inflight -= 1
            req.kv_len += len(emitted)
        if speculative:
            req.verify_ct += 1
            req.spec_emitted += len(emitted)
        logprobs = (out.logprobs[i], out.top_ids[i], out.top_logprobs[i]) if req.params.return_logprob else ()
        req.append(emitted, *logprobs)
        if req.finished:
            self.retire(req)
        return True

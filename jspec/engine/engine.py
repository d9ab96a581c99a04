"""Engine: a worker (params, device state, compiled steps), the scheduler, and the loop.

The overlap loop (docs/architecture.md, "Host side"): launch step N+1, then read step N's outputs,
which were already copying to the host (copy_to_host_async started at
launch). The synchronous mode (disable_overlap_schedule=True) runs the very
same code but reads each step's outputs right after launching it; it is the
reference the overlap mode must match.

    engine = Engine("/path/to/model", page_size=16)
    rid = engine.add_request("Hello", SamplingParams(max_new_tokens=16))
    while engine.has_work():
        for out in engine.step():
            print(out.rid, out.new_token_ids, out.finished)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time

import jax
import numpy as np

from jspec.checkpoint.model import as_model, load_logged, with_context_length
from jspec.config.engine import ACCELERATOR_MIXED_CHUNK_SLOWDOWN, EngineConfig
from jspec.config.sampling import SamplingParams
from jspec.constrained.grammar import GrammarCompiler
from jspec.engine.build import build_worker, loads_per_layer
from jspec.engine.outputs import GenerationOutput, as_prompt_list, tokenize_prompt
from jspec.layers.sampling import SAMPLING_MODES, sampling_mode
from jspec.lora.adapter import load_adapter
from jspec.scheduler.detokenize import IncrementalDetokenizer, StopChecker
from jspec.scheduler.dp_scheduler import DPScheduler
from jspec.scheduler.request import Request
from jspec.scheduler.scheduler import Scheduler
from jspec.scheduler.sync import designated_read, start_host_copy
from jspec.speculative.adaptive import AdaptivePolicy, CostTable
from jspec.steps.common import unpack_output
from jspec.worker.base import PendingLaunch
from jspec.worker.batch import DecodeBatch, DPBatch, PrefillBatch
from jspec.worker.programs import decode_jobs, decode_ready, enable_compilation_cache, measure_step_costs

log = logging.getLogger("jspec.engine")


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    # With params.return_logprob: the new tokens' logprobs and top-n (token id, logprob) pairs.
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # all output tokens so far
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    spec_verify_ct: int = 0  # speculative iterations so far (0 without speculation)
    matched_stop: int | str | None = None
    error: str | None = None  # why the request failed on the server's side (e.g. its prefill engine died)
    # With params.wants_prompt_logprobs, on the request's first output (its prompt is scored by
    # then): GenerationOutput's input_logprobs and input_top_logprobs.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and a later one of the same request as one (a reader that fell behind
        takes the steps it missed in one go)."""

        def joined(a, b):
            return None if a is None and b is None else (a or []) + (b or [])

        # Built from later's fields directly: dataclasses.replace costs several times more, and a
        # loaded server joins outputs for every lagging stream at every step.
        return RequestOutput(
            **{
                **later.__dict__,
                "new_token_ids": self.new_token_ids + later.new_token_ids,
                "new_text": self.new_text + later.new_text,
                "new_logprobs": joined(self.new_logprobs, later.new_logprobs),
                "new_top_logprobs": joined(self.new_top_logprobs, later.new_top_logprobs),
                "input_logprobs": self.input_logprobs or later.input_logprobs,
                "input_top_logprobs": self.input_top_logprobs or later.input_top_logprobs,
            }
        )


# The engine-side inter-token latency histogram: bins of this width, the last one open-ended.
TOKEN_GAP_BIN_MS = 0.25
TOKEN_GAP_BINS = 400


def empty_token_gaps() -> dict[str, list[int]]:
    return {"decode": [0] * TOKEN_GAP_BINS, "mixed": [0] * TOKEN_GAP_BINS}


@dataclasses.dataclass
class LoopTimes:
    """Where the loop's host time goes, summed over iterations (seconds).

    `wait_s` is the time blocked on the device at the designated read; everything else is
    host work that the overlap loop must hide behind the device's step.
    """

    iterations: int = 0
    schedule_s: float = 0.0  # Scheduler.schedule: admission, page growth, batch building
    launch_s: float = 0.0  # building the step's inputs and dispatching the jitted step
    wait_s: float = 0.0  # blocked on the previous step's outputs
    process_s: float = 0.0  # accept bookkeeping, detokenizing, stop checks, outputs
    prefill_steps: int = 0  # launches that prefill (some with decode rows beside, when mixed)
    mixed_steps: int = 0  # of those, launches that carried running requests' decode rows too
    decode_steps: int = 0  # launches that only decode
    # Requests summed over iterations, counted as each iteration schedules: running (or mid-
    # prefill) and waiting for admission. Per iteration, they say whether a load left the batch
    # short because requests waited (admission) or because none had arrived (the frontend).
    running_sum: int = 0
    waiting_sum: int = 0
    # Each request's gaps between consecutive token outputs as the loop processed them (its
    # inter-token latency before the HTTP path), binned by the kind of step that gave the later
    # tokens: whether a served ITL percentile comes from the steps or from the stream after them.
    token_gaps: dict[str, list[int]] = dataclasses.field(default_factory=empty_token_gaps)

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.launch_s + self.process_s

    def count_token_gaps(self, prefill: bool, gained, now: float) -> None:
        """Bins each request's time since its last tokens (none before its first token) under
        the kind of step that gave them: a prefill step's are its decode rows' (mixed)."""
        bins = self.token_gaps["mixed" if prefill else "decode"]
        for r in gained:
            if r.last_token_time is not None:
                i = int((now - r.last_token_time) * 1e3 / TOKEN_GAP_BIN_MS)
                bins[min(i, TOKEN_GAP_BINS - 1)] += 1
            r.last_token_time = now

    def per_iteration_ms(self) -> dict:
        n = max(self.iterations, 1)
        return {
            k: 1e3 * v / n
            for k, v in (
                ("schedule", self.schedule_s),
                ("launch", self.launch_s),
                ("process", self.process_s),
                ("host", self.host_s),
                ("wait", self.wait_s),
            )
        }


@dataclasses.dataclass
class Launched:
    """A step in flight: its batch, and its outputs (device arrays, copying to the host)."""

    batch: PrefillBatch | DecodeBatch | DPBatch
    outputs: object


def is_prefill(batch) -> bool:
    """Whether a launched batch prefills (its decode rows, if any, ride along: a mixed step)."""
    return isinstance(batch, PrefillBatch) or (isinstance(batch, DPBatch) and batch.is_prefill)


def mixed_step_slowdown(config: EngineConfig) -> float:
    """How many times its rows' decode step a plain step that prefills while it decodes may
    cost (0: no bound but the chunk size). Without an accelerator a step's cost grows with its
    tokens from the first one, so there the chunk size alone bounds it, as before."""
    if config.disable_mixed_chunk:
        return 0.0
    if config.mixed_chunk_slowdown is not None:
        return config.mixed_chunk_slowdown
    return ACCELERATOR_MIXED_CHUNK_SLOWDOWN if jax.default_backend() != "cpu" else 0.0


class Engine:
    """A model served by a worker and a scheduler. model: a loaded Model, or a checkpoint (a
    directory or a Hub repo id) read with `load` (a LoadConfig: revision, dtype, tokenizer, ...).
    Settings: an EngineConfig, or its fields as keywords (`Engine(model, page_size=16,
    tp_size=2)`); draft: EAGLE / STANDALONE weights given in memory, as (DraftConfig, params),
    instead of config.speculative.draft_model_path.

    Given a checkpoint, the engine holds the weights alone. A Model you hold keeps its arrays:
    on the GPU, where the layers run from per-layer copies, the loader's stacked layers then
    stay on the device beside them, and the pool is sized around both."""

    def __init__(self, model, config: EngineConfig | None = None, *, draft=None, load=None, **settings):
        config = dataclasses.replace(config or EngineConfig(), **settings)
        self.config = config
        # Before anything compiles: a second process reuses this one's programs.
        enable_compilation_cache(config.compilation_cache)
        if isinstance(model, (str, os.PathLike)):
            # Loaded here, the engine holds the loader's weights alone and frees them once the
            # worker has laid them out, before the KV pool is sized.
            model = load_logged(model, load, per_layer=loads_per_layer(config))
        self.model = with_context_length(as_model(model), config.context_length)
        target_path = self.model.path  # where NEXTN finds the target's own MTP layers
        del model
        self.spec = config.speculative
        # The worker takes the weights (a copy of the Model hands them over): the engine keeps
        # none, so what the loader made is freed unless the caller holds it.
        weights, self.model = dataclasses.replace(self.model), dataclasses.replace(self.model, params=None)
        self.worker, self.plan = build_worker(weights, config, draft, target_path)
        self.adaptive = None  # the AdaptivePolicy, when speculation picks its draft shape per iteration
        if self.spec is not None and self.spec.adaptive:
            costs = CostTable.load(self.spec.adaptive_cost_table) if self.spec.adaptive_cost_table else None
            self.adaptive = AdaptivePolicy(tuple(m.spec.shape for m in self.worker.methods), costs)
            if costs is not None:
                log.info("adaptive speculation: cost table %s", costs.source)
        # Speculation with grammar rows reads each proposed tree before verifying it.
        self.worker.host_read = designated_read
        self.scheduler = self.make_scheduler()
        # A scheduler that mixes decode rows into prefills may bound those steps' cost (from costs
        # timed at warm-up); the bound picks among finer prefill token buckets.
        self.mixed_slowdown = mixed_step_slowdown(config) if self.scheduler.mixed_chunk else 0.0
        if self.mixed_slowdown:
            self.worker.buckets = dataclasses.replace(self.worker.buckets, prefill_ratio=2)
        self.prefix_cache = self.scheduler.prefix_cache
        self.lora = self.worker.lora
        self.overlap = not config.disable_overlap_schedule
        self._inflight: Launched | None = None
        self._seeds = np.random.default_rng(config.random_seed)  # seeds for requests that bring none
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self.num_steps = 0
        self.loop_times = LoopTimes()
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        self._last_processed = time.perf_counter()
        for name, path in config.lora_paths.items():
            self.load_lora(name, path)

    # ---- hooks: what an engine built on this one (PD disaggregation) changes --------------------

    def make_scheduler(self):
        """The scheduler of this engine's worker (called once, when the worker is built)."""
        if self.config.enable_dp_attention:
            return DPScheduler(
                self.worker,
                disable_radix_cache=self.config.disable_radix_cache,
                load_balance_method=self.config.load_balance_method,
            )
        return Scheduler(
            self.worker,
            disable_radix_cache=self.config.disable_radix_cache,
            mixed_chunk=self.worker.mixes_decode_rows and not self.config.disable_mixed_chunk,
        )

    def on_launched(self, launched: Launched) -> None:
        """Called right after each step's launch, before the next step can donate its state."""

    def on_processed(self, launched: Launched, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Called with each processed step's outputs; returns the outputs the caller gets."""
        return outputs

    # ---- LoRA adapters -----------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> int:
        """Reads a PEFT adapter and makes it resident under `name` (requests pick it with
        SamplingParams(lora_path=name)); no restart, no recompilation. Returns its pool slot."""
        if self.lora is None:
            raise ValueError(
                "this engine serves no LoRA adapters; create it with enable_lora, max_loras_per_batch or lora_paths"
            )
        return self.worker.load_lora(load_adapter(name, path, self.model.cfg, self.lora.max_rank))

    def unload_lora(self, name: str) -> None:
        """Frees an adapter's slot; refused while a request that uses it is queued or running."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters")
        users = sorted(r.rid for r in self.scheduler.requests.values() if r.params.lora_path == name and not r.finished)
        if users:
            raise ValueError(
                f"LoRA adapter {name!r} is in use by running requests {users}; abort them or wait "
                f"until they finish before unloading it"
            )
        self.lora.unload(name)

    def warmup(self, sampling_modes=None, prompt_logprobs: bool = False) -> int:
        """Compiles every bucketed program the loop can launch; sampling_modes (default all of
        jspec.layers.sampling.SAMPLING_MODES) narrows it, leaving the rest to compile at first use, and
        prompt_logprobs adds the prefills that score prompt tokens (otherwise compiled in the
        background when a request first asks). Returns the programs compiled."""
        n = self.worker.warmup(sampling_modes or SAMPLING_MODES, prompt_logprobs)
        self._log_program_memory()
        if self.adaptive is not None and self.adaptive.costs is None:
            self._measure_costs()
        if self.mixed_slowdown:
            self._bound_mixed_steps()
        return n

    def _bound_mixed_steps(self) -> None:
        """Times the prefill and decode buckets and lets the scheduler cut its mixed steps to
        mixed_slowdown times their decode rows' step."""
        self.drain()
        costs = measure_step_costs(self.worker)
        slowdown = self.mixed_slowdown
        self.scheduler.step_costs, self.scheduler.mixed_slowdown = costs, slowdown
        log.info(
            "mixed steps cost at most %gx their decode rows' step: tokens per step by decode rows %s "
            "(prefill ms by tokens %s; decode ms by rows %s)",
            slowdown,
            ", ".join(f"{b}: {costs.mixed_step_tokens(b, slowdown)}" for b in costs.decode),
            ", ".join(f"{t}: {s * 1e3:.2f}" for t, s in costs.prefill.items()),
            ", ".join(f"{b}: {s * 1e3:.2f}" for b, s in costs.decode.items()),
        )

    def _log_program_memory(self) -> None:
        """Each compiled program's device memory beside its arguments, once; a program whose
        temporaries are as large as a quarter of the pool holds a copy of a pool-sized buffer."""
        report = self.worker.programs.memory_report() if hasattr(self.worker, "programs") else {}
        if not report:
            return
        log.info(
            "programs' device memory beside their arguments (GiB): %s",
            ", ".join(f"{k}: {m.needs_bytes / 2**30:.3f}" for k, m in sorted(report.items())),
        )
        pool = self.plan.pool_bytes
        for label, m in report.items():
            if m.temp_bytes >= pool / 4 and pool >= 2**30:
                log.warning(
                    "program %s needs %.2f GiB of temporaries beside a %.2f GiB KV pool: it copies a pool-sized buffer",
                    label,
                    m.temp_bytes / 2**30,
                    pool / 2**30,
                )

    def _measure_costs(self) -> None:
        """The adaptive policy's cost table, timed on the device (at warm-up, or before the first
        decode of an engine that was not warmed up). The other shapes' greedy programs compile
        for it here; their sampled ones and the ragged verifies compile when first wanted."""
        self.drain()
        w = self.worker
        w.programs.compile_all(decode_jobs(w, ["greedy"], shapes=range(1, w.num_shapes)))
        self.adaptive.costs = w.measure_costs()
        log.info("adaptive speculation: cost table %s", self.adaptive.costs.source)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, prompt, params: SamplingParams | None = None, rid: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate()
        ids = tokenize_prompt(prompt, self.model)
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: add_request takes one completion; add the request n times with "
                f"different seeds, or use Engine.generate / jspec.generate, which fan out"
            )
        if params.top_logprobs_num > self.config.max_top_logprobs:
            raise ValueError(
                f"top_logprobs_num={params.top_logprobs_num} exceeds this engine's max_top_logprobs="
                f"{self.config.max_top_logprobs}"
            )
        vocab = self.model.cfg.vocab_size
        outside = sorted(t for t in params.logit_bias or {} if not 0 <= t < vocab)
        if outside:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {vocab}): {outside[:8]}")
        tok = self.model.tokenizer
        if params.stop and tok is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        lora_slot = lora_uid = 0
        if params.lora_path is not None:
            if self.lora is None:
                raise ValueError(f"lora_path={params.lora_path!r}, but this engine serves no LoRA adapters")
            lora_slot = self.lora.slot_of(params.lora_path)
            lora_uid = self.lora.adapters[params.lora_path].uid
        eos = set(self.model.cfg.eos_token_ids) | (set(tok.eos_token_ids) if tok is not None else set())
        # Never generate past the model's context.
        room = self.model.cfg.max_position_embeddings - len(ids)
        if room < params.max_new_tokens:
            params = dataclasses.replace(params, max_new_tokens=room)
        self.check_grammar(params)
        grammar = None
        if params.grammar is not None:
            grammar = self.grammar_compiler.matcher(*params.grammar, params.reasoning_format)
        checker = StopChecker(params.stop, params.stop_token_ids, eos, params.ignore_eos, params.max_new_tokens)
        detok = IncrementalDetokenizer(tok, ids) if tok is not None else None
        req = Request(
            rid,
            ids,
            params,
            checker,
            detok,
            arrival=next(self._arrival),
            seed=params.seed if params.seed is not None else int(self._seeds.integers(2**32)),
            lora_slot=lora_slot,
            cache_namespace=lora_uid,
            grammar=grammar,
        )
        self.scheduler.add(req)
        return rid

    # ---- structured outputs --------------------------------------------------------------------

    # Why this kind of engine refuses grammars (None: it runs them); PD engines set theirs.
    grammar_refusal: str | None = None

    @property
    def grammar_compiler(self):
        """The engine's GrammarCompiler (built at first use: it reads the whole vocabulary)."""
        with self._grammar_lock:  # the server's threads and the loop may ask first at once
            return self._make_grammar_compiler()

    def _make_grammar_compiler(self):
        if self._grammar_compiler is None:
            tok = self.model.tokenizer
            eos = set(self.model.cfg.eos_token_ids) | set(tok.eos_token_ids)
            self._grammar_compiler = GrammarCompiler.for_tokenizer(
                tok,
                self.model.cfg.vocab_size,
                sorted(eos),
                cache_size=self.config.grammar_cache_size,
                compile_timeout_s=self.config.grammar_compile_timeout,
            )
        return self._grammar_compiler

    def check_grammar(self, params: SamplingParams) -> None:
        """Refuses a request's grammar (ValueError naming why) if this engine cannot run it, or
        llguidance rejects it (GrammarError, a ValueError); compiles it into the cache
        otherwise. The server calls it off the loop's thread, so the loop never compiles."""
        grammar = params.grammar
        if grammar is None:
            return
        kind = grammar[0]
        if self.config.grammar_backend == "none":
            raise ValueError(f"{kind}: structured outputs are off on this engine (grammar_backend='none')")
        if self.grammar_refusal is not None:
            raise ValueError(f"{kind}: structured outputs are not implemented with {self.grammar_refusal}")
        if not self.worker.supports_grammar:
            raise ValueError(f"{kind}: structured outputs are not implemented with DP attention")
        if self.model.tokenizer is None:
            raise ValueError(f"{kind}: structured outputs need the model's tokenizer; this model has none")
        self.grammar_compiler.compile(*grammar, params.reasoning_format)

    def abort(self, rid: str) -> bool:
        """Finishes a request now and frees its KV; True if it was still running or waiting."""
        return self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and launches one batch, and processes the previous one (overlap) or this one (sync)."""
        times, t0 = self.loop_times, time.perf_counter()
        sched = self.scheduler
        times.running_sum += len(sched.running) + len(sched.prefilling)
        times.waiting_sum += len(sched.waiting)
        batch = sched.schedule()
        if batch is None and self._inflight is None and sched.has_work():
            # Nothing could run: the waiting requests' programs are still compiling.
            self.worker.wait_for_programs()
        t1 = time.perf_counter()
        launched = self._launch(batch) if batch is not None else None
        times.schedule_s += t1 - t0
        times.launch_s += time.perf_counter() - t1
        times.iterations += 1
        if self.overlap:
            done, self._inflight = self._inflight, launched
            outputs = self._process(done) if done is not None else []
            # A launch with grammar rows finishes here: its masks follow from the tokens just
            # processed, and its first half has kept the device busy meanwhile.
            self._finish(launched)
            return outputs
        self._finish(launched)
        return self._process(launched) if launched is not None else []

    def _launch(self, batch) -> Launched:
        if self.adaptive is not None and isinstance(batch, DecodeBatch):
            choice = self._choose_shape(batch)
            # Grammar rows verify whole trees (the deferred launch has no ragged verify): the
            # policy's shape is kept, its opt-outs dropped.
            batch.shape, batch.drafting = choice.shape, None if batch.grammars is not None else choice.drafting
        out = self.worker.launch(batch)
        launched = Launched(batch, out)
        self.num_steps += 1
        if is_prefill(batch):
            self.loop_times.prefill_steps += 1
            self.loop_times.mixed_steps += isinstance(batch, PrefillBatch) and batch.mixed
        else:
            self.loop_times.decode_steps += 1
        if not isinstance(out, PendingLaunch):
            launched.outputs = start_host_copy(out)
            self.on_launched(launched)
        return launched

    def _finish(self, launched: Launched | None) -> None:
        """Dispatches the second half of a launch that waited for the host (PendingLaunch)."""
        if launched is None or not isinstance(launched.outputs, PendingLaunch):
            return
        t0 = time.perf_counter()
        launched.outputs = start_host_copy(launched.outputs.finish())
        self.on_launched(launched)
        self.loop_times.launch_s += time.perf_counter() - t0

    def _choose_shape(self, batch: DecodeBatch):
        if self.adaptive.costs is None:
            self._measure_costs()
        mode = sampling_mode(p for p, _ in batch.sampling)
        rows = len(batch.reqs)

        def ready(i: int, drafting_rows: int | None) -> bool:
            # The configured shape for every row is always compiled; the rest once ready.
            return (i == 0 and drafting_rows is None) or decode_ready(self.worker, rows, mode, i, drafting_rows)

        return self.adaptive.choose(self.adaptive.alphas(batch.reqs), self.worker.buckets.decode_bucket(rows), ready)

    def _process(self, launched: Launched) -> list[RequestOutput]:
        t_start = time.perf_counter()
        before = {
            id(r): (len(r.output), len(r.text), len(r.output_logprobs), len(r.output_top_logprobs))
            for r in launched.batch.reqs
        }
        t0 = time.perf_counter()
        host = unpack_output(designated_read(launched.outputs), self.worker.top_n)
        t1 = time.perf_counter()
        if isinstance(launched.batch, PrefillBatch):
            touched = self.scheduler.on_prefill_done(launched.batch, host)
        else:
            touched = self.scheduler.on_decode_done(launched.batch, host, self.spec is not None)
            if self.adaptive is not None:
                now = time.perf_counter()
                b = launched.batch
                self.adaptive.observe(b.shape, b.reqs, host.accept_len, now - self._last_processed, b.drafting)
        gained = [r for r in touched if len(r.output) > before[id(r)][0]]
        self.loop_times.count_token_gaps(is_prefill(launched.batch), gained, t1)
        outputs = self.on_processed(launched, [self.output(r, *before[id(r)]) for r in touched])
        self._last_processed = time.perf_counter()
        times = self.loop_times
        times.wait_s += t1 - t0
        times.process_s += time.perf_counter() - t1 + (t0 - t_start)
        return outputs

    @staticmethod
    def output(r, n_out: int, n_text: int, n_lp: int, n_top: int) -> RequestOutput:
        """r's RequestOutput: what it produced since its output, text and logprobs had these lengths."""
        lp = r.params.return_logprob
        first = n_out == 0 and (bool(r.output) or r.finished) and r.params.wants_prompt_logprobs
        return RequestOutput(
            r.rid,
            r.output[n_out:],
            r.text[n_text:],
            r.finished,
            r.finish_reason,
            r.output_logprobs[n_lp:] if lp else None,
            r.output_top_logprobs[n_top:] if lp else None,
            len(r.prompt),
            len(r.output),
            r.num_cached_tokens,
            r.verify_ct,
            r.matched_stop,
            r.error,
            r.input_logprobs if first else None,
            r.input_top_logprobs if first and r.params.top_logprobs_num else None,
        )

    def drain(self) -> None:
        """Waits for and processes the step in flight (for shutdown and idle checks)."""
        if self._inflight is not None:
            done, self._inflight = self._inflight, None
            self._finish(done)
            self._process(done)

    def check_idle_no_leaks(self) -> None:
        """At idle every page and request slot is back: the leak check of docs/architecture.md."""
        if self.has_work():
            raise AssertionError("engine is not idle")
        self.scheduler.check_no_leaks()

    # ---- convenience -------------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None):
        """Runs prompts to completion; returns GenerationOutputs in order (n per prompt when
        params.n > 1, prompt by prompt)."""
        # Every prompt checked (and errors named by its index) before any is submitted.
        prompts = [tokenize_prompt(p, self.model, i) for i, p in enumerate(as_prompt_list(prompts))]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        rids = []
        try:
            for p, sp in zip(prompts, plist):
                sp.validate()
                for one in sp.completions():
                    rids.append(self.add_request(p, one))
        except Exception:
            for rid in rids:  # all or nothing: a bad prompt leaves no half-submitted batch behind
                self.abort(rid)
            raise
        reqs = {rid: self.scheduler.requests[rid] for rid in rids}
        while self.has_work():
            self.step()
        tok = self.model.tokenizer
        results = []
        for rid in rids:
            r = reqs[rid]
            results.append(
                GenerationOutput(
                    r.prompt,
                    r.output,
                    r.finish_reason,
                    r.text if tok is not None else None,
                    r.verify_ct,
                    r.spec_emitted / r.verify_ct if r.verify_ct else None,
                    r.output_logprobs if r.params.return_logprob else None,
                    r.output_top_logprobs if r.params.return_logprob and r.params.top_logprobs_num else None,
                    r.input_logprobs if r.params.wants_prompt_logprobs else None,
                    r.input_top_logprobs if r.params.wants_prompt_logprobs and r.params.top_logprobs_num else None,
                )
            )
        return results

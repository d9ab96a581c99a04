"""The compiled step programs of a worker: which there are, compiling them, and JAX's
persistent compilation cache.

A worker launches a handful of programs, one per (step, bucketed shape, sampling program):
`Buckets` says which shapes. `Programs` compiles each ahead of its first use
(`jit(...).lower(...).compile()`), so warm-up costs compilation only, several programs compile
at once on threads (XLA releases the GIL), and a rare program can compile in the background
while the loop keeps launching the others. Launches call the compiled executable directly.

The planning functions below take a worker (worker/base.py) and find its programs by
launching it on scratch inputs while `Programs` records the launches instead of running them
(padding rows write only the scratch page and slot).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

from jspec.config.sampling import SamplingParams
from jspec.constrained.grammar import allow_all
from jspec.layers.batch import bucket
from jspec.layers.sampling import SAMPLING_MODES
from jspec.worker import executables
from jspec.worker.executables import ExecutableCache, program_key
from jspec.worker.inputs import SeqChunk

log = logging.getLogger("jspec.worker.programs")
# The smallest token bucket of a prefill.
MIN_PREFILL_TOKENS = 16

# XLA:GPU's rematerialization pass counts a donated, aliased argument (the KV pool) as both an
# input and an output, so a pool that fills the device looks like twice the device to it, and
# every program's compile logged that it could not reduce memory below its limit (it had nothing
# to rematerialize: XLA's memory analysis of the same programs shows no pool-sized buffer). The
# limit is (device memory - arguments) x this factor / 100: large enough, the pass has no reason
# to run and no warning to give.
GPU_COMPILER_OPTIONS = {"xla_gpu_memory_limit_slop_factor": 10_000}


def compiler_options() -> dict:
    """The XLA options every step program compiles with on this backend."""
    return dict(GPU_COMPILER_OPTIONS) if jax.default_backend() == "gpu" else {}


# Where compiled step programs are stored whole (worker/executables.py), beside JAX's cache.
EXECUTABLES: ExecutableCache | None = None


def enable_compilation_cache(path: str | None) -> None:
    """Turns on JAX's persistent compilation cache in `path` (None: leaves it off), and the
    store of whole executables in its `jspec-executables` folder. A second process that builds
    the same program for the same backend loads it from there."""
    global EXECUTABLES
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    EXECUTABLES = ExecutableCache(os.path.join(path, "jspec-executables"))
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program counts: the quick ones add up over a warm-up.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def programs_loaded() -> int:
    """Programs this process loaded rather than compiled: whole executables, and compiles that
    JAX's persistent cache answered."""
    return CacheHits.hits + (EXECUTABLES.loaded if EXECUTABLES is not None else 0)


class CacheHits:
    """How many compiles JAX's persistent cache answered, counted from JAX's monitoring events
    (process-wide), so that a slow warm-up says whether it compiled or loaded; and whether a
    compile on this thread was XLA's own work (JAX reports on the compiling thread)."""

    hits = 0
    _lock = threading.Lock()
    _listening = False
    _thread = threading.local()

    @classmethod
    def compile_fresh(cls, compile_fn: Callable) -> tuple[Any, bool]:
        """compile_fn()'s result, and whether XLA compiled it: not JAX's persistent cache, nor
        JAX's in-memory cache handing back an executable from before."""
        cls.listen()
        cls._thread.hit = cls._thread.compiled = False
        result = compile_fn()
        return result, cls._thread.compiled and not cls._thread.hit

    @classmethod
    def listen(cls) -> None:
        with cls._lock:
            if not cls._listening:
                jax.monitoring.register_event_listener(cls._on_event)
                jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
                cls._listening = True

    @classmethod
    def _on_event(cls, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            cls._thread.hit = True
            with cls._lock:
                cls.hits += 1

    @classmethod
    def _on_duration(cls, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":  # a compile or a persistent-cache hit
            cls._thread.compiled = True


@dataclasses.dataclass(frozen=True)
class Program:
    """One program: step lowered with these static arguments, for arguments of one shape."""

    key: Hashable
    step: Callable
    static: dict
    label: str


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """A compiled program's device memory beside its arguments: its temporaries, and outputs
    that are new buffers (not donated arguments written in place)."""

    temp_bytes: int
    new_output_bytes: int
    argument_bytes: int
    aliased_bytes: int  # outputs written into donated arguments

    @property
    def needs_bytes(self) -> int:
        return self.temp_bytes + self.new_output_bytes

    @classmethod
    def of(cls, compiled) -> ProgramMemory:
        m = compiled.memory_analysis()
        if m is None:  # a backend that does not say
            return cls(0, 0, 0, 0)
        alias = m.alias_size_in_bytes
        return cls(m.temp_size_in_bytes, max(0, m.output_size_in_bytes - alias), m.argument_size_in_bytes, alias)


@dataclasses.dataclass(frozen=True)
class Job:
    """A program and arguments of its shape: what it compiles from (warm-up) or runs on."""

    program: Program
    args: tuple


class Programs:
    """Compiled programs by key. `run` launches one, compiling it first if it is new."""

    def __init__(self, mesh=None):
        self.mesh = mesh  # programs lower and run under it (jax.set_mesh), when there is one
        self.compiled: dict[Hashable, Any] = {}
        self.labels: dict[Hashable, str] = {}
        self._pending: dict[Hashable, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jspec-compile")
        self.collecting: list[Job] | None = None  # set: launches are recorded, not run (warm-up)

    def clear(self) -> None:
        """Forgets every program (the arguments' shapes changed, e.g. LoRA columns were added)."""
        with self._lock:
            self.compiled.clear()
            self.labels.clear()

    def ready(self, key: Hashable) -> bool:
        return key in self.compiled

    def run(self, program: Program, args: tuple):
        fn = self.compiled.get(program.key)
        if fn is None:
            if self.collecting is not None:
                self.collecting.append(Job(program, args))
                return None
            pending = self._pending.get(program.key)
            fn = pending.result() if pending is not None else self._compile(Job(program, args))
        elif self.collecting is not None:
            return None
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh):
            return fn(*args)

    def _compile(self, job: Job):
        p = job.program
        options = compiler_options()
        storable = EXECUTABLES is not None and executables.ENABLED and self.mesh is None
        device = executables.one_device(job.args) if storable else None
        key = program_key(p.step, p.static, job.args, options) if device is not None else None
        fn = EXECUTABLES.load(key, device) if key else None
        if fn is None:
            with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
                fn, fresh = CacheHits.compile_fresh(
                    lambda: p.step.lower(*abstract_args(job.args), **p.static).compile(compiler_options=options)
                )
            # An executable that JAX deserialized does not serialize whole again (XLA:CPU drops
            # its kernels' code: the copy fails when run), so only XLA's fresh compiles are stored.
            if key and fresh:
                EXECUTABLES.save(key, fn)
        with self._lock:
            self.compiled[p.key] = fn
            self.labels[p.key] = p.label
        return fn

    def memory(self, key: Hashable) -> ProgramMemory:
        """A compiled program's device memory (XLA's memory analysis)."""
        return ProgramMemory.of(self.compiled[key])

    def memory_report(self) -> dict[str, ProgramMemory]:
        """Every compiled program's device memory, by label."""
        with self._lock:
            items = list(self.compiled.items())
        return {self.labels.get(k, str(k)): ProgramMemory.of(fn) for k, fn in items}

    def compile_in_background(self, job: Job) -> None:
        """Starts compiling job's program unless it is compiled or on its way; ready() tells when."""
        key = job.program.key
        with self._lock:
            if key in self.compiled or key in self._pending:
                return
            self._pending[key] = future = self._background.submit(self._compile, job)
        future.add_done_callback(lambda f, key=key: self._pending.pop(key, None))

    def pending(self, key: Hashable) -> bool:
        """Whether key's program is compiling in the background."""
        return key in self._pending

    def compiling(self) -> bool:
        """Whether a background compile is under way."""
        return bool(self._pending)

    def wait_pending(self) -> None:
        """Blocks until every background compile has finished."""
        for f in list(self._pending.values()):
            f.result()

    def compile_all(self, jobs: list[Job], threads: int | None = None) -> int:
        """Compiles every new job's program, `threads` at a time, logging progress. Returns how many."""
        jobs = [j for j in {j.program.key: j for j in jobs}.values() if j.program.key not in self.compiled]
        if not jobs:
            return 0
        threads = threads or max(1, min(len(jobs), os.cpu_count() or 1))
        progress = Progress(len(jobs))
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jspec-warmup") as pool:
            futures = {pool.submit(self._compile, j): j for j in jobs}
            for f in concurrent.futures.as_completed(futures):
                f.result()
                progress.done(futures[f].program.label)
        progress.close()
        return len(jobs)


class Progress:
    """`compiled n / N programs` lines with the elapsed time; one redrawn bar on a terminal."""

    def __init__(self, total: int):
        self.total, self.n, self.t0 = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        CacheHits.listen()
        self.loaded0 = programs_loaded()

    def done(self, label: str) -> None:
        self.n += 1
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            width = 30
            fill = width * self.n // self.total
            sys.stderr.write(
                f"\r[jspec] compiling [{'#' * fill}{'.' * (width - fill)}] {self.n}/{self.total} "
                f"{elapsed:5.1f}s  {label[:40]:<40}"
            )
            sys.stderr.flush()
        else:
            log.info("compiled %d/%d programs (%s), %.1f s", self.n, self.total, label, elapsed)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
        log.info(
            "compiled %d programs in %.1f s (%d loaded from the compilation cache)",
            self.total,
            time.perf_counter() - self.t0,
            programs_loaded() - self.loaded0,
        )


def prefill_token_buckets(chunked_prefill_size: int, smallest: int = MIN_PREFILL_TOKENS, ratio: int = 4) -> list[int]:
    """Powers of `ratio` from `smallest` below the chunk size, then the chunk size (a multiple of 8)."""
    out, t = [], smallest
    while t < chunked_prefill_size:
        out.append(t)
        t *= ratio
    return out + [max(bucket(chunked_prefill_size, 8), smallest)]


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The shapes a worker's batches pad to, so that warm-up can compile every program the loop
    will run: prefill batches vary in tokens T (their rows follow from T: inputs.prefill_rows);
    decode batches vary in rows B."""

    chunked_prefill_size: int
    max_slots: int
    decode_paddings: tuple[int, ...] | None = None  # precompile_bs_paddings (None: every power of two)
    # Powers of four keep the programs few (a prefill is one read of the weights whatever its T);
    # a scheduler that bounds its mixed steps' cost wants powers of two to choose among.
    prefill_ratio: int = 4

    def prefill_token_buckets(self) -> list[int]:
        """Token counts a prefill pads to: powers of prefill_ratio up to the chunk size."""
        return prefill_token_buckets(self.chunked_prefill_size, ratio=self.prefill_ratio)

    def prefill_tokens(self, total: int) -> int:
        """The bucket a prefill of `total` tokens pads to."""
        for t in self.prefill_token_buckets():
            if total <= t:
                return t
        return bucket(total)

    def decode_buckets(self) -> list[int]:
        """Row counts a decode pads to: the powers of two up to max_slots', or with paddings
        given those (clipped to it) and every power of two past the largest."""
        top = bucket(self.max_slots)
        every = [1 << i for i in range(top.bit_length())]
        if not self.decode_paddings:
            return every
        chosen = {min(b, top) for b in self.decode_paddings}
        return [b for b in every if b in chosen or b > max(chosen)]

    def decode_bucket(self, rows: int) -> int:
        """The bucket a decode of this many rows pads to."""
        return next((b for b in self.decode_buckets() if b >= rows), bucket(rows))


def prefill_key(T: int, with_prompt_logprobs: bool, top_n: int, sampling: str) -> tuple:
    return ("prefill", T, with_prompt_logprobs, top_n, sampling)


def decode_key(B: int, mode: str, top_n: int, shape: int, verify_tokens: int | None = None) -> tuple:
    return ("decode", B, mode, top_n, shape, verify_tokens)


@contextlib.contextmanager
def recording(worker):
    """Within: the worker's launches are recorded into the yielded list of Jobs, not run."""
    collecting, worker.programs.collecting = worker.programs.collecting, []
    try:
        yield worker.programs.collecting
    finally:
        worker.programs.collecting = collecting
        worker.last_decode = None  # the scratch batch is not the loop's


def scratch_sampling(mode: str) -> tuple[SamplingParams, int]:
    """A scratch request's (sampling params, seed) of a sampling program ("greedy", "sampled")."""
    return (SamplingParams(temperature=1.0) if mode == "sampled" else SamplingParams(), 0)


def abstract_args(args):
    """The arguments as shapes, dtypes and shardings, layouts left out: what a program is lowered
    from. The state that a deserialized executable returned carries that program's concrete
    layout, and newer JAX lowers a concrete layout as a type of its own, so a scan over
    the KV pool would find its carry's input and output types differ."""
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
            if isinstance(x, jax.Array)
            else x
        ),
        args,
    )


def scratch_decode(worker, B: int, mode: str = "greedy", **kw):
    """Launches a decode of B scratch rows (they write only the scratch page and slot)."""
    return worker.decode([worker.scratch_slot] * B, [[0]] * B, [scratch_sampling(mode)] * B, **kw)


def scratch_prefill(worker, T: int, mode: str = "greedy", **kw):
    """Launches a prefill of one sequence of T tokens on the scratch page; `following` set, so no
    slot is touched."""
    pages = [0] * (-(-T // worker.page_size))
    return worker.prefill([SeqChunk([0] * T, 0, pages)], [0], [None], [scratch_sampling(mode)], **kw)


def prefill_programs(worker, sampling_modes) -> list[str]:
    """The sampling programs of the prefills that serve these sampling modes."""
    return sorted({worker.prefill_program(m) for m in sampling_modes})


def prefill_jobs(worker, with_prompt_logprobs: bool, sampling_modes=SAMPLING_MODES) -> list[Job]:
    """The prefill programs of every token bucket for these sampling modes (recorded, not run)."""
    with recording(worker) as jobs:
        for T in worker.buckets.prefill_token_buckets():
            for mode in prefill_programs(worker, sampling_modes):
                scratch_prefill(worker, T, mode, with_prompt_logprobs=with_prompt_logprobs)
    return jobs


def decode_jobs(worker, sampling_modes, shapes) -> list[Job]:
    """The decode programs of every row bucket for these sampling programs and draft shapes
    (recorded, not run). Warm-up takes the configured shape's; an adaptive engine the others'."""
    with recording(worker) as jobs:
        for shape in shapes:
            for B in worker.buckets.decode_buckets():
                for mode in sampling_modes:
                    scratch_decode(worker, B, mode, shape=shape)
    return jobs


def grammar_jobs(worker) -> list[Job]:
    """The masked programs of every decode bucket and sampling program, and of every prefill
    token bucket (recorded, not run)."""
    with recording(worker) as jobs:
        for B in worker.buckets.decode_buckets():
            for mode in SAMPLING_MODES:
                scratch_decode(worker, B, mode, grammars=[None] * B)
        for T in worker.buckets.prefill_token_buckets():
            for mode in prefill_programs(worker, SAMPLING_MODES):
                scratch_prefill(worker, T, mode, vocab_masks=allow_all(1, worker.vocab_size))
    return jobs


def warmup_jobs(worker, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> list[Job]:
    """The programs warm-up compiles: every launch shape, recorded on scratch inputs."""
    unknown = set(sampling_modes) - set(SAMPLING_MODES)
    if unknown:
        raise ValueError(f"unknown sampling modes {sorted(unknown)}; choose from {SAMPLING_MODES}")
    jobs = []
    for with_prompt in (False, True) if prompt_logprobs else (False,):
        jobs += prefill_jobs(worker, with_prompt, sampling_modes)
    return jobs + decode_jobs(worker, sampling_modes, shapes=(0,))


def warm_up(worker, sampling_modes=SAMPLING_MODES, prompt_logprobs: bool = False) -> int:
    """Compiles every bucketed program the loop runs (without running them), so the serving
    loop never compiles. Returns the number of programs. Prompt-logprob prefills are left
    out unless asked for: they compile in the background when a request first needs them;
    so do the masked programs of structured outputs (grammar_programs_ready)."""
    worker.warmed_up = True
    return worker.programs.compile_all(warmup_jobs(worker, sampling_modes, prompt_logprobs))


def compile_when_missing(worker, keys, jobs) -> bool:
    """Whether the programs of keys are compiled; if not, and nothing compiles in the
    background, starts compiling jobs() there (the loop goes on with other programs)."""
    if all(worker.programs.ready(k) for k in keys):
        return True
    if not worker.programs.compiling():
        for job in jobs():
            worker.programs.compile_in_background(job)
    return False


def prompt_logprob_programs_ready(worker) -> bool:
    """Whether the prefills that score prompt tokens are compiled; if not, starts compiling
    them in the background (the loop goes on with requests that do not need them)."""
    keys = [
        prefill_key(T, True, worker.top_n, mode)
        for T in worker.buckets.prefill_token_buckets()
        for mode in prefill_programs(worker, SAMPLING_MODES)
    ]
    return compile_when_missing(worker, keys, lambda: prefill_jobs(worker, True))


def grammar_programs_ready(worker) -> bool:
    """Whether the programs that take token bitmasks are compiled; if not, starts compiling
    them in the background (requests without a grammar go on meanwhile). A worker that did
    not warm up compiles each at its first use instead, as all its programs."""
    if not worker.warmed_up:
        return True
    jobs = None
    if worker.grammar_keys is None:
        jobs = grammar_jobs(worker)
        worker.grammar_keys = [j.program.key for j in jobs]
    return compile_when_missing(worker, worker.grammar_keys, lambda: jobs if jobs is not None else grammar_jobs(worker))


def decode_ready(worker, rows: int, mode: str, shape: int, drafting_rows: int | None = None) -> bool:
    """Whether the decode program for this many rows, sampling program, shape and (with rows
    opted out of drafting) drafting rows is compiled; if not, starts compiling it in the
    background (the loop runs another program meanwhile)."""
    B = worker.buckets.decode_bucket(rows)
    tokens = None if drafting_rows is None else worker.verify_tokens(B, shape, drafting_rows)
    key = decode_key(B, mode, worker.top_n, shape, tokens)
    if worker.programs.ready(key):
        return True
    if worker.programs.pending(key):
        return False
    drafting = None if drafting_rows is None else [i < drafting_rows for i in range(B)]
    with recording(worker) as jobs:
        scratch_decode(worker, B, mode, shape=shape, drafting=drafting)
    for job in jobs:
        worker.programs.compile_in_background(job)
    return False


def measure_programs(worker) -> dict[str, ProgramMemory]:
    """Compiles the largest prefill and the largest decode (both sampling programs; every draft
    shape's, for adaptive speculation) for the worker's current state and returns their device
    memory by label: what sizing reserves for the programs beside the weights and the pool."""
    B, T = worker.buckets.decode_buckets()[-1], worker.buckets.prefill_token_buckets()[-1]
    with recording(worker) as jobs:
        scratch_prefill(worker, T, "sampled")  # the larger of the two sampling programs
        for mode in SAMPLING_MODES:
            scratch_decode(worker, B, mode)
        # A larger draft shape than the configured one makes a larger program (a wider tree).
        for shape in range(1, worker.num_shapes):
            scratch_decode(worker, B, shape=shape)
    worker.programs.compile_all(jobs)
    return {j.program.label: worker.programs.memory(j.program.key) for j in jobs}


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Seconds of one prefill step per token bucket (decode rows ride in it as one-token rows)
    and of one greedy decode per row bucket, timed on this device: what a scheduler needs to
    bound the cost of a step that prefills while it decodes."""

    prefill: dict[int, float]
    decode: dict[int, float]

    def mixed_step_tokens(self, decode_rows: int, slowdown: float) -> int:
        """The most tokens, decode rows included, that a step carrying decode_rows may pad to
        and still cost at most `slowdown` times the decode step of those rows; never less than
        the smallest bucket past the rows, so that waiting prompts always progress (0 when no
        bucket is past them)."""
        rows = next((b for b in sorted(self.decode) if b >= decode_rows), max(self.decode))
        past = sorted(t for t in self.prefill if t > decode_rows)
        if not past:
            return 0
        fits = [t for t in past if self.prefill[t] <= slowdown * self.decode[rows]]
        return max(fits, default=past[0])


# Runs per program when measure_step_costs times the buckets: at least the first number, then
# more for the short ones until they have run for the seconds given, at most the second. A few
# percent between two timings decides a mixed step's token budget (a bucket fits under the
# bound or not), and a small model's steps, a millisecond or two of mostly host launch, vary
# by more than that from run to run; the least of a dozen runs varies far less.
STEP_COST_RUNS = (3, 12)
STEP_COST_SECONDS = 0.05


def measure_step_costs(worker) -> StepCosts:
    """Times every prefill token bucket and greedy decode row bucket on scratch rows (they write
    only the scratch page and slot): the least of its runs after one that may compile. The runs
    go round the programs in turn, so that a stretch of slow host time (another thread's work,
    the clock) falls on every program's rounds alike rather than on a few programs' whole share:
    what decides the budget is the ratio of two of them."""
    least_runs, most_runs = STEP_COST_RUNS
    launches = {
        ("prefill", T): functools.partial(scratch_prefill, worker, T) for T in worker.buckets.prefill_token_buckets()
    }
    launches |= {("decode", B): functools.partial(scratch_decode, worker, B) for B in worker.buckets.decode_buckets()}
    for launch in launches.values():
        jax.block_until_ready(launch())
    times: dict[tuple[str, int], list[float]] = {key: [] for key in launches}
    for _ in range(most_runs):
        for key, launch in launches.items():
            runs = times[key]
            if len(runs) >= least_runs and sum(runs) >= STEP_COST_SECONDS:
                continue
            t0 = time.perf_counter()
            jax.block_until_ready(launch())
            runs.append(time.perf_counter() - t0)
    worker.last_decode = None  # the scratch batch is not the loop's
    least = {key: min(runs) for key, runs in times.items()}
    return StepCosts(
        {n: t for (kind, n), t in least.items() if kind == "prefill"},
        {n: t for (kind, n), t in least.items() if kind == "decode"},
    )


def first_step(worker) -> None:
    """Runs the largest greedy decode once over scratch rows (they write only the scratch page
    and slot): what the first step over a new pool costs is paid at start-up."""
    jax.block_until_ready(scratch_decode(worker, worker.buckets.decode_buckets()[-1]))
    worker.last_decode = None

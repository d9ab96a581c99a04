"""The compiled step programs of a worker, and JAX's persistent compilation cache.

A worker launches a handful of programs, one per (step, bucketed shape, sampling program).
`Programs` compiles each ahead of its first use (`jit(...).lower(...).compile()`), so warm-up
costs compilation only, several programs compile at once on threads (XLA releases the GIL),
and a rare program can compile in the background while the loop keeps launching the others.
Launches call the compiled executable directly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

log = logging.getLogger("jspec.worker.programs")


def enable_compilation_cache(path: str | None) -> None:
    """Turns on JAX's persistent compilation cache in `path` (None: leaves it off). A second
    process that compiles the same program for the same backend loads it from there."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program counts: the quick ones add up over a warm-up.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            fn = p.step.lower(*job.args, **p.static).compile()
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
        log.info("compiled %d programs in %.1f s", self.total, time.perf_counter() - self.t0)

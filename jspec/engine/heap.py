"""The Python heap of a serving process: collected once and frozen after start-up.

A process that has loaded a model and compiled its programs holds a few hundred thousand
long-lived Python objects (the loaded modules, JAX's traced and compiled programs, the
tokenizer). Python's oldest-generation collection walks all of them, which takes tens of
milliseconds on a server's CPU and happens at moments no one chooses: in the engine's loop that
is one step's tokens late, an inter-token latency spike. Collected once and moved to the
permanent generation (gc.freeze), they are never walked again; collections then look at what
the serving itself allocates. vLLM and LightLLM freeze their serving processes' heaps the same
way; `EngineConfig.disable_gc_freeze` keeps Python's default.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

log = logging.getLogger("jspec.engine")
_SERVING_PAUSES: GcPauses | None = None


def settle_heap(process: str, *, freeze: bool) -> None:
    """Once a serving process has started: collects what is garbage now and, with freeze,
    moves every object left (the start-up heap) out of Python's collections, logging how many
    and how long the collection took; from then on the process's collections are counted
    (serving_gc_pauses: the engine's stats carry them)."""
    global _SERVING_PAUSES
    t0 = time.perf_counter()
    gc.collect()
    collect_s = time.perf_counter() - t0
    if freeze:
        gc.freeze()
        log.info(
            "%s: %d start-up objects frozen out of Python's collections (the last full one took %.0f ms)",
            process,
            gc.get_freeze_count(),
            collect_s * 1e3,
        )
    if _SERVING_PAUSES is None:
        _SERVING_PAUSES = GcPauses().__enter__()


def serving_gc_pauses() -> GcPauses | None:
    """This process's collections since settle_heap, if it ran here."""
    return _SERVING_PAUSES


@dataclasses.dataclass
class GcPauses:
    """Python's collections while it is installed: how many of each generation and how long
    the longest took (gc.callbacks)."""

    count: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])
    total_ms: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_ms: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])
    _started = None  # perf_counter() at the running collection's start (not a field)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        ms = (time.perf_counter() - self._started) * 1e3
        self._started = None
        g = info["generation"]
        self.count[g] += 1
        self.total_ms[g] += ms
        self.max_ms[g] = max(self.max_ms[g], ms)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

"""What a server reads of its engine: the facts fixed once it serves (EngineFacts) and a
snapshot of its state (EngineStats).

The HTTP routes never touch the Engine itself: it may run on another thread or in another
process (engine_process.py). Both are plain picklable values, taken on the engine's side: the
facts once at start-up, the stats on the engine's loop between steps, when a route asks.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import jax

from jspec.config.model import ModelConfig
from jspec.engine.heap import serving_gc_pauses


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What does not change while an engine serves."""

    model_cfg: ModelConfig  # with the engine's context length
    # The most prompt + new tokens one request may hold: the context length, or less where the
    # KV pool holds less (a small pool on the CPU).
    max_request_tokens: int
    tokenizer: object  # the checkpoint's Tokenizer, or None
    max_top_logprobs: int  # top logprobs every step returns (the worker's top_n)
    dtype: str
    page_size: int
    overlap: bool
    plan: dict  # the KV pool's sizing (PoolPlan.describe)
    speculative: dict | None  # the SpecConfig's fields
    adaptive: bool  # speculation picks its draft shape per iteration
    grammar_backend: str
    device_kind: str
    num_devices: int
    jax_version: str


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's state between two steps."""

    requests: int
    running: int
    waiting: int
    usage: dict[str, int]  # KV pages and request slots (Scheduler.usage)
    loop: dict[str, float]  # the loop's summed host and device-wait times (LoopTimes)
    lora_adapters: dict[str, str]  # resident adapter name -> its path
    adaptive: dict | None  # the AdaptivePolicy's state (describe)
    adaptive_counts: tuple[dict, dict, dict] | None  # its stats: chosen, seconds, accept_ema
    pid: int  # the engine loop's process and native thread id (benchmarks read their CPU time)
    thread_id: int
    # Python's collections in the engine's process since it started serving (engine/heap.py
    # GcPauses: count, total_ms, max_ms per generation); None outside a serving process.
    gc: dict | None = None


def serving_facts(engine) -> EngineFacts:
    """engine's facts, taken when it starts serving. Builds the grammar compiler now too: it
    reads the whole vocabulary, which the first grammar request should not wait for."""
    model, worker, spec = engine.model, engine.worker, engine.spec
    if model.tokenizer is not None and engine.config.grammar_backend != "none":
        engine.grammar_compiler  # noqa: B018
    return EngineFacts(
        model_cfg=model.cfg,
        max_request_tokens=min(model.cfg.max_position_embeddings, engine.scheduler.max_request_tokens),
        tokenizer=model.tokenizer,
        max_top_logprobs=worker.top_n,
        dtype=str(worker.dtype),
        page_size=worker.page_size,
        overlap=engine.overlap,
        plan=engine.plan.describe(),
        speculative=dataclasses.asdict(spec) if spec is not None else None,
        adaptive=engine.adaptive is not None,
        grammar_backend=engine.config.grammar_backend,
        device_kind=jax.devices()[0].device_kind,
        num_devices=jax.device_count(),
        jax_version=jax.__version__,
    )


def lora_adapters(engine) -> dict[str, str]:
    lora = engine.lora
    return {name: a.path for name, a in lora.adapters.items()} if lora is not None else {}


def engine_stats(engine) -> EngineStats:
    """engine's state; called on its loop's thread, between steps."""
    sched, policy = engine.scheduler, engine.adaptive
    counts = None
    if policy is not None:
        counts = (dict(policy.stats.chosen), dict(policy.stats.seconds), dict(policy.stats.accept_ema))
    return EngineStats(
        requests=len(sched.requests),
        running=len(sched.running) + len(sched.prefilling),
        waiting=len(sched.waiting),
        usage=sched.usage(),
        loop=dataclasses.asdict(engine.loop_times),
        lora_adapters=lora_adapters(engine),
        adaptive=policy.describe() if policy is not None else None,
        adaptive_counts=counts,
        pid=os.getpid(),
        thread_id=threading.get_native_id(),
        gc=dataclasses.asdict(pauses) if (pauses := serving_gc_pauses()) is not None else None,
    )

"""Prometheus metrics of the server (prometheus_client: the reference implementation of the
exposition format, so every scraper parses it).

Counters and histograms are fed by the HTTP side as outputs stream out; engine state
(requests running and waiting, KV pages used, adaptive speculation's choices) comes from the
engine's stats (EngineStats), asked for when scraped.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jspec.engine.facts import EngineStats
from jspec.speculative.adaptive import shape_label

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class AdaptiveCollector:
    """Adaptive speculation's choices, from the stats of the last scrape."""

    def __init__(self):
        self.counts: tuple[dict, dict, dict] = ({}, {}, {})  # EngineStats.adaptive_counts

    def collect(self):
        chosen_counts, seconds_per_shape, accept_ema = self.counts
        chosen = CounterMetricFamily(
            "jspec_spec_adaptive_iterations",
            "Decode iterations per draft shape and batch bucket",
            labels=["shape", "bucket"],
        )
        for (b, shape), n in chosen_counts.items():
            chosen.add_metric([shape_label(shape), str(b)], n)
        seconds = CounterMetricFamily(
            "jspec_spec_adaptive_seconds", "Loop time spent in iterations of each draft shape", labels=["shape"]
        )
        for shape, t in seconds_per_shape.items():
            seconds.add_metric([shape_label(shape)], t)
        accept = GaugeMetricFamily(
            "jspec_spec_adaptive_accept_length", "Accepted drafts per iteration (EMA) per draft shape", labels=["shape"]
        )
        for shape, a in accept_ema.items():
            accept.add_metric([shape_label(shape)], a)
        return [chosen, seconds, accept]


class ServerMetrics:
    """adaptive: whether the engine picks its draft shapes per iteration (their metrics then)."""

    def __init__(self, adaptive: bool = False):
        self.registry = r = CollectorRegistry()
        self.prompt_tokens = Counter("jspec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("jspec_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("jspec_requests", "Finished requests, by finish reason", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "jspec_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "jspec_inter_token_latency_seconds",
            "Time between streamed outputs, per token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jspec_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS + (40.96, 81.92), registry=r
        )
        self.accept_length = Histogram(
            "jspec_spec_accept_length",
            "Tokens emitted per speculative iteration, per finished request",
            buckets=tuple(range(1, 17)),
            registry=r,
        )
        self.running = Gauge("jspec_num_requests_running", "Requests decoding or prefilling", registry=r)
        self.waiting = Gauge("jspec_num_requests_waiting", "Requests queued", registry=r)
        self.pages_used = Gauge("jspec_kv_pages_used", "KV pages held (requests and prefix cache)", registry=r)
        self.pages_total = Gauge("jspec_kv_pages_total", "KV pages in the pool", registry=r)
        self.adaptive = None
        if adaptive:
            self.adaptive = AdaptiveCollector()
            r.register(self.adaptive)

    def finished(
        self, prompt_tokens: int, completion_tokens: int, reason: str | None, e2e_s: float, verify_ct: int
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.requests.labels(finish_reason=reason or "unknown").inc()
        self.e2e.observe(e2e_s)
        if verify_ct:
            self.accept_length.observe(max(completion_tokens - 1, 0) / verify_ct)

    def observer(self, t0: float):
        """What feeds these metrics from one HTTP request's outputs (index, RequestOutput) as they
        pass; t0: when the request arrived."""
        last: dict[int, float] = {}

        def observe(i: int, out) -> None:
            now = time.perf_counter()
            if i not in last:
                self.ttft.observe(now - t0)
            elif out.new_token_ids:
                per = (now - last[i]) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.itl.observe(per)
            last[i] = now
            self.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                self.finished(out.prompt_tokens, out.completion_tokens, out.finish_reason, now - t0, out.spec_verify_ct)

        return observe

    def exposition(self, stats: EngineStats) -> bytes:
        """The metrics in Prometheus' text format, with the engine's state from stats."""
        usage = stats.usage
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.pages_used.set(usage["kv_pages_total"] - usage["kv_pages_free"])
        self.pages_total.set(usage["kv_pages_total"])
        if self.adaptive is not None and stats.adaptive_counts is not None:
            self.adaptive.counts = stats.adaptive_counts
        return generate_latest(self.registry)

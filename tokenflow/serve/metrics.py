"""Prometheus metrics of an Engine, for a `/metrics` route.

Gauges are read from `engine.stats()` when scraped (nothing to keep in sync);
request outcomes are counted by an engine observer; time to first token and
latency are histograms fed by the HTTP routes. Each app gets its own
`CollectorRegistry`, so several apps (or tests) in one process never clash.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ("EngineMetrics",)

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BREAKER_STATES = ("closed", "open", "half_open")

# stats() key -> (metric name, help)
_GAUGES = {
    "num_waiting": ("tokenflow_requests_waiting", "Requests queued for the model"),
    "num_running": ("tokenflow_requests_running", "Requests in the running batch"),
    "kv_blocks_used": ("tokenflow_kv_blocks_used", "KV blocks referenced by requests"),
    "kv_blocks_cached": ("tokenflow_kv_blocks_cached", "Unreferenced KV blocks holding a cached prefix"),
    "kv_blocks_free": ("tokenflow_kv_blocks_free", "Free KV blocks"),
    "kv_blocks_total": ("tokenflow_kv_blocks_total", "KV blocks in the pool"),
    "prefix_cache_hit_rate": ("tokenflow_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache"),
    "tokens_per_s": ("tokenflow_generation_tokens_per_second", "Generated tokens per second (last 10 s)"),
    "num_preemptions": ("tokenflow_preemptions", "Requests preempted so far"),
}


class EngineMetrics(Collector):
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenflow_requests", "Requests by outcome", ["outcome"], registry=self.registry)
        self.ttft = Histogram("tokenflow_time_to_first_token_seconds", "Time to first token", buckets=_BUCKETS,
                              registry=self.registry)
        self.latency = Histogram("tokenflow_request_latency_seconds", "Request latency", buckets=_BUCKETS,
                                 registry=self.registry)
        self.registry.register(self)

    # EngineObserver
    def on_step(self, duration_s: float, ok: bool) -> None:
        pass

    def on_request_end(self, request: Any, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.engine.stats() if self.engine is not None else {}
        for key, (name, doc) in _GAUGES.items():
            if isinstance(stats.get(key), (int, float)):
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        state = stats.get("breaker_state")
        if state is not None:
            family = GaugeMetricFamily("tokenflow_breaker_state", "Circuit breaker state (1 = current)",
                                       labels=["state"])
            for s in _BREAKER_STATES:
                family.add_metric([s], 1.0 if state == s else 0.0)
            yield family

    def render(self) -> bytes:
        return generate_latest(self.registry)

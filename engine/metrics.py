"""Prometheus metrics of one engine app (its own registry: no module globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.active = Gauge("specprefill_engine_active_requests", "Requests waiting or running", registry=self.registry)
        self.requests = Counter(
            "specprefill_engine_requests", "Completion requests by outcome", ["status"], registry=self.registry
        )
        self.cache_info = Gauge(
            "specprefill_engine_cache_info",
            "The prefix cache (1; its shape in the labels, as vllm:cache_config_info)",
            ["block_size", "capacity_tokens"],
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "specprefill_engine_request_queue_time_seconds",
            "Seconds from a request's arrival to its first step (as vllm:request_queue_time_seconds)",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.yields = Counter(
            "specprefill_engine_background_yields",
            "Background prefill chunks stopped between two layers for a request that may not wait behind them",
            registry=self.registry,
        )

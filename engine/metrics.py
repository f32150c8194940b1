"""Prometheus metrics of one engine app (its own registry: no module globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.active = Gauge("specprefill_engine_active_requests", "Requests waiting or running",
                            registry=self.registry)
        self.requests = Counter("specprefill_engine_requests", "Completion requests by outcome", ["status"],
                                registry=self.registry)
        self.cache_info = Gauge("specprefill_engine_cache_info", "The prefix cache (1; its shape in the labels, "
                                "as vllm:cache_config_info)", ["block_size", "capacity_tokens"], registry=self.registry)

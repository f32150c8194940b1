"""Prometheus metrics of one gateway app (its own registry: no module globals). In a worker of a multi-worker
gateway (``common.workers``) ``/metrics`` shows the sum over the workers, from prometheus_client's multiprocess
files, with this worker's own readings of the replicas and the cost models beside it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.workers import shared_metrics_dir

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._readings: list[Collector] = []  # read from this process at each scrape (not summed over workers)
        self._exposed: CollectorRegistry | None = None
        self._requests(self.registry)
        self._planning(self.registry)
        self._backends(self.registry)

    def _requests(self, r: CollectorRegistry) -> None:
        """What clients sent and got."""
        self.requests = Counter(
            "specprefill_requests", "Chat and completion requests", ["endpoint", "status", "reason"], registry=r
        )
        self.errors = Counter("specprefill_errors", "Answers with an error", ["endpoint", "code"], registry=r)
        self.shed = Counter(
            "specprefill_requests_shed",
            "Requests answered 503 at once because the engine's queue would have held them past --max-queue-wait",
            registry=r,
        )
        self.ttft = Histogram(
            "specprefill_ttft_seconds",
            "Request received to first answer byte",
            ["endpoint", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.draft_latency = Histogram(
            "specprefill_draft_seconds", "Draft scoring time", ["outcome"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.mapping_latency = Histogram(
            "specprefill_draft_mapping_seconds",
            "Mapping a prompt onto a draft with another tokenizer",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.original_tokens = Histogram(
            "specprefill_original_prompt_tokens", "Prompt tokens received", buckets=TOKEN_BUCKETS, registry=r
        )
        self.kept_tokens = Histogram(
            "specprefill_kept_prompt_tokens", "Prompt tokens forwarded", buckets=TOKEN_BUCKETS, registry=r
        )
        self.keep_rate = Histogram(
            "specprefill_keep_rate",
            "Keep rate applied to compressed requests",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0),
            registry=r,
        )

    def _planning(self, r: CollectorRegistry) -> None:
        """The draft, the score cache and the plans."""
        self.cache = Counter("specprefill_score_cache", "Score cache lookups", ["result"], registry=r)
        self.plans = Counter(
            "specprefill_plans", "Backend requests by plan (whole, fresh, extend, warm)", ["kind"], registry=r
        )
        self.engine_cache_error = Histogram(
            "specprefill_engine_cache_error_tokens",
            "Prompt tokens the engine served from its cache minus those the gateway predicted",
            buckets=(-4096, -1024, -256, -64, -1, 0, 64, 256, 1024, 4096),
            registry=r,
        )
        self.kv_events = Counter(
            "specprefill_kv_events",
            "The backend's KV cache events followed: blocks stored and "
            "removed, clears, batches replayed, restarts and gaps seen (the model then started "
            "empty), batches that could not be read",
            ["kind"],
            registry=r,
        )

    def _backends(self, r: CollectorRegistry) -> None:
        """The engines: requests at them, the swap, warming and the replicas."""
        self.in_flight = Gauge(
            "specprefill_backend_requests_in_flight",
            "Backend requests under way",
            ["kind"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.swap_mismatch = Counter(
            "specprefill_swap_mismatch",
            "Swaps the backend refused because its rendering differed; those requests went whole",
            ["cause"],
            registry=r,
        )
        self.warming = Counter(
            "specprefill_warming",
            "Warming by outcome: offered (a recurring context), piece (one "
            "piece landed), done (the whole prompt landed), superseded (by its next turn), "
            "failed",
            ["outcome"],
            registry=r,
        )
        self.warming_pending = Gauge(
            "specprefill_warming_pending_contexts",
            "Recurring contexts waiting to be warmed (pieces go in the engine's idle time)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.behind_background = Histogram(
            "specprefill_foreground_behind_background_seconds",
            "Requests that found this gateway's background work "
            "(a warming piece) at the engine, and the time they were there alongside it",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.routed = Counter(
            "specprefill_replica_requests",
            "Requests sent to each replica (its place in --backend-url), failovers included",
            ["replica"],
            registry=r,
        )
        self.failovers = Counter(
            "specprefill_replica_failovers",
            "Requests a replica dropped before their first event (refused, or gone), sent to another",
            registry=r,
        )

    def exposed(self) -> CollectorRegistry:
        """What ``/metrics`` shows: this app's registry, or in a worker the sum over the workers."""
        folder = shared_metrics_dir()
        if folder is None:
            return self.registry
        if self._exposed is None:
            from prometheus_client import multiprocess

            self._exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._exposed, folder)  # type: ignore[no-untyped-call]
            for reading in self._readings:
                self._exposed.register(reading)
        return self._exposed

    def _read_at_scrape(self, reading: Collector) -> None:
        self.registry.register(reading)
        self._readings.append(reading)
        self._exposed = None

    def expose_replicas(self, replicas: list[Any]) -> None:
        """Whether each replica is in the routing (1) or out (0), read at each scrape."""

        class Up:
            def collect(self) -> Iterator[GaugeMetricFamily]:
                family = GaugeMetricFamily(
                    "specprefill_replica_up",
                    "1 while the replica is routed to, 0 while it "
                    "is out (refused a request or failed its health check)",
                    labels=["replica"],
                )
                for replica in replicas:
                    family.add_metric([str(replica.index)], float(replica.up))
                yield family

        self._read_at_scrape(Up())

    def expose_costs(self, models: dict[str, Any]) -> None:
        """The cost models' current coefficients on /metrics (``models``: name -> CostModel)."""

        class Costs:
            def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
                family = GaugeMetricFamily(
                    "specprefill_cost_coefficient",
                    "Calibrated cost model coefficients (seconds per unit)",
                    labels=["model", "term"],
                )
                resets = CounterMetricFamily(
                    "specprefill_cost_model_resets",
                    "Times a cost model priced several prefills in a row far below what they took, and started "
                    "again from those timings",
                    labels=["model"],
                )
                for name, model in models.items():
                    for term, value in model.describe().items():
                        family.add_metric([name, term], value)
                    resets.add_metric([name], model.resets)
                yield family
                yield resets

        self._read_at_scrape(Costs())

"""A plan: what goes to the backend for one request, and the response headers that say so (``planner`` makes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Plan:
    """What goes to the backend for one request, and the response headers that say so."""

    token_ids: list[int]
    status: str = "bypassed"
    reason: str | None = None
    kept_indices: list[int] | None = None  # None: the whole prompt
    keep_rate: float = 1.0
    cache: str = "off"
    draft_ms: float = 0.0
    passthrough: bool = False  # forward the client's body unchanged
    kind: str = "whole"  # whole, fresh or extend
    protected: bool = False  # the system prompt kept whole
    recurring: bool = False  # a context likely to come back (a system prompt, or the start of an earlier prompt)
    engine_cached: int = 0  # prompt tokens the engine is expected to serve from its prefix cache
    target_s: float = 0.0  # the target's predicted time for what is sent, on an idle engine
    wait_ms: float = 0.0  # the predicted wait for the requests ahead of it at the engine (when it was sent)
    predicted_ms: float = 0.0  # the predicted backend time: the wait, then the target's time (when it was sent)
    background_ms: float = 0.0  # time at the backend alongside this gateway's own background work
    tokenize_ms: float = 0.0
    select_ms: float = 0.0
    backend_ms: float = 0.0  # request sent to first answer event received
    replica: Any = None  # the ``gateway.replicas.Replica`` it goes to (None: the only one)

    @property
    def original_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kept_tokens(self) -> int:
        return len(self.kept_indices) if self.kept_indices is not None else len(self.token_ids)

    def kept_token_ids(self) -> list[int]:
        if self.kept_indices is None:
            return self.token_ids
        return [self.token_ids[i] for i in self.kept_indices]

    def position_ids(self) -> list[int]:
        return self.kept_indices if self.kept_indices is not None else list(range(len(self.token_ids)))

    def headers(self) -> dict[str, str]:
        headers = {
            "x-specprefill-status": self.status,
            "x-specprefill-original-tokens": str(self.original_tokens),
            "x-specprefill-kept-tokens": str(self.kept_tokens),
            "x-specprefill-keep-rate": f"{self.keep_rate:g}",
            "x-specprefill-cache": self.cache,
            "x-specprefill-draft-ms": f"{self.draft_ms:.1f}",
            "x-specprefill-plan": self.kind,
        }
        if self.reason:
            headers["x-specprefill-reason"] = self.reason
        timings = (
            ("tokenize", self.tokenize_ms),
            ("draft", self.draft_ms),
            ("select", self.select_ms),
            ("backend", self.backend_ms),
            ("predicted", self.predicted_ms),
            ("wait", self.wait_ms),
            ("background", self.background_ms),
        )
        headers["server-timing"] = ", ".join(f"{name};dur={value:.1f}" for name, value in timings) + (
            f', plan;desc="{self.kind}", cached;desc="{self.engine_cached}"'
        )
        if self.replica is not None:
            headers["server-timing"] += f', replica;desc="{self.replica.index}"'
        return headers

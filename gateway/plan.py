"""Planning: what goes to the backend for one request. Bypass reasons, then scores, then the selection rule."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

from draft_worker.selector import select_tokens
from gateway.draft import DraftClient
from gateway.metrics import GatewayMetrics
from gateway.policy import Reason, RequestOptions
from gateway.scores import ScoreProvider
from gateway.settings import GatewaySettings

logger = logging.getLogger("specprefill.gateway")


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
    tokenize_ms: float = 0.0
    select_ms: float = 0.0
    backend_ms: float = 0.0  # request sent to first answer event received

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
        }
        if self.reason:
            headers["x-specprefill-reason"] = self.reason
        headers["server-timing"] = ", ".join(
            f"{name};dur={value:.1f}"
            for name, value in (("tokenize", self.tokenize_ms), ("draft", self.draft_ms),
                                ("select", self.select_ms), ("backend", self.backend_ms))
        )
        return headers


class Planner:
    def __init__(self, settings: GatewaySettings, draft: DraftClient, scores: ScoreProvider, metrics: GatewayMetrics,
                 special_ids: Collection[int]) -> None:
        self.settings = settings
        self.draft = draft
        self.scores = scores
        self.metrics = metrics
        self.special_ids = frozenset(special_ids)

    async def plan(self, token_ids: list[int], options: RequestOptions, unsupported: list[str]) -> Plan:
        n = len(token_ids)
        self.metrics.original_tokens.observe(n)
        if not options.enabled:
            return Plan(token_ids, reason=Reason.OFF, passthrough=True)
        if unsupported:
            return Plan(token_ids, reason=Reason.unsupported(unsupported[0]), passthrough=True)
        if options.keep_rate >= 1.0:
            return Plan(token_ids, reason=Reason.KEEP_RATE_ONE)
        if n < self.settings.min_prompt_tokens:
            return Plan(token_ids, reason=Reason.SHORT_PROMPT)
        if n > self.draft.max_prompt_tokens:
            return Plan(token_ids, reason=Reason.PROMPT_TOO_LONG)
        start = time.perf_counter()
        try:
            scores, cache = await asyncio.wait_for(self.scores.scores(token_ids), self.settings.draft_timeout)
        except Exception as exc:  # any draft fault: the full prompt goes through instead
            draft_ms = (time.perf_counter() - start) * 1e3
            self.metrics.draft_latency.labels("error").observe(draft_ms / 1e3)
            logger.warning("draft failed, forwarding the full prompt: %s",
                           type(exc).__name__ + (f": {exc}" if str(exc) else ""))
            return Plan(token_ids, reason=Reason.DRAFT_ERROR, draft_ms=draft_ms)
        draft_ms = (time.perf_counter() - start) * 1e3
        if cache != "hit":
            self.metrics.draft_latency.labels("ok").observe(draft_ms / 1e3)
        start = time.perf_counter()
        kept = select_tokens(token_ids, scores, options.keep_rate, self.draft.config, self.special_ids)
        self.metrics.keep_rate.observe(options.keep_rate)
        return Plan(token_ids, status="compressed", kept_indices=kept, keep_rate=options.keep_rate,
                    cache=cache, draft_ms=draft_ms, select_ms=(time.perf_counter() - start) * 1e3)

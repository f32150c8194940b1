"""Token scores for a prompt: from the cache when it has them, else from the draft, once per prompt.

Concurrent identical prompts share one draft call (single flight). The call runs as its own task, so a
client that gives up does not cancel the scores that others, or the cache, are waiting for.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from gateway.metrics import GatewayMetrics
from gateway.planning.draft import DraftClient
from gateway.planning.score_cache import ScoreCache, score_key

logger = logging.getLogger("specprefill.gateway")


class ScoreProvider:
    def __init__(
        self, draft: DraftClient, cache: ScoreCache | None, metrics: GatewayMetrics, key_prefix: str = "specprefill:"
    ) -> None:
        self.draft = draft
        self.cache = cache
        self.metrics = metrics
        self.key_prefix = key_prefix
        self._inflight: dict[str, asyncio.Task[Any]] = {}

    async def scores(self, token_ids: list[int]) -> tuple[torch.Tensor, str]:
        """The prompt's token scores and where they came from: ``hit``, ``miss`` or ``off`` (no cache)."""
        identity = await self.draft.identity()
        key = score_key(self.key_prefix, identity, self.draft.score_params, token_ids)
        status = "off"
        if self.cache is not None:
            status, cached = await self.cache.get(key)
            self.metrics.cache.labels(status if status != "off" else "error").inc()
            if cached is not None and cached.numel() == len(token_ids):
                return cached, "hit"
            if status == "hit":  # a value of the wrong length: treat as a miss
                status = "miss"
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._compute(key, token_ids))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(task), status

    async def _compute(self, key: str, token_ids: list[int]) -> torch.Tensor:
        scores = await self.draft.score(token_ids)
        if self.cache is not None:
            await self.cache.put(key, scores)
        return scores

    async def close(self) -> None:
        if self.cache is not None:
            await self.cache.close()

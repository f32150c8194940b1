"""Draft clients: what the gateway asks for token scores, in this process or from remote draft workers."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Protocol

import httpx
import torch

from common.blocks import Ints
from common.telemetry import outgoing_headers
from draft_worker.baselines import BaselineScorer
from draft_worker.codec import scores_from_text
from draft_worker.config import ScoringConfig
from draft_worker.worker import DraftWorker
from gateway.planning.selections import RecentPrompts

logger = logging.getLogger("specprefill.gateway")


class DraftUnavailableError(RuntimeError):
    """No draft worker could score the prompt."""


class DraftClient(Protocol):
    @property
    def config(self) -> ScoringConfig:
        """Selection options (chunk size, protection) the gateway applies."""
        ...

    @property
    def score_params(self) -> tuple[int, ...]: ...

    @property
    def max_prompt_tokens(self) -> int: ...

    async def identity(self) -> str: ...

    async def score(self, token_ids: list[int]) -> torch.Tensor: ...

    def reusable_prefix(self, token_ids: Ints) -> int:
        """Tokens of this prompt whose draft KV is kept from an earlier one (they cost no draft prefill)."""
        ...

    async def ready(self) -> bool: ...

    async def close(self) -> None: ...


class LocalDraft:
    """The draft worker in this process; forwards run in a thread so the event loop keeps serving."""

    def __init__(self, worker: DraftWorker | BaselineScorer) -> None:
        self.worker = worker
        self.config = worker.config
        self.score_params = worker.config.score_params
        self.max_prompt_tokens = worker.max_prompt_tokens

    async def identity(self) -> str:
        return self.worker.identity

    async def score(self, token_ids: list[int]) -> torch.Tensor:
        return await asyncio.to_thread(self.worker.score, token_ids)

    def reusable_prefix(self, token_ids: Ints) -> int:
        cache = self.worker.prefix_cache
        return cache.reusable(token_ids) if cache is not None else 0

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        return None


class RemoteDraft:
    """Spreads scoring over ``specprefill draft-worker`` services, round-robin.

    A worker that fails (unreachable, timed out, 5xx) is skipped for ``cooldown`` seconds and the next
    one is tried; when none answers, ``score`` raises and the gateway forwards the full prompt.
    """

    def __init__(self, urls: list[str], config: ScoringConfig, *, timeout: float = 30.0, cooldown: float = 5.0):
        self.urls = [u.rstrip("/") for u in urls]
        self.config = config
        self.score_params = config.score_params
        self.max_prompt_tokens = 1 << 31  # each worker checks its own limit
        self.cooldown = cooldown
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=2.0))
        self._down_until = {url: 0.0 for url in self.urls}
        self._rotation = itertools.cycle(range(len(self.urls)))
        self._identity: str | None = None
        self._recent: RecentPrompts[None] = RecentPrompts(capacity=32)  # sent lately: a worker likely keeps their KV

    async def identity(self) -> str:
        if self._identity is None:
            for url in self._candidates():
                try:
                    info = (await self._client.get(f"{url}/v1/info")).raise_for_status().json()
                except httpx.HTTPError as exc:
                    self._mark_down(url, exc)
                    continue
                self._identity = info["identity"]
                self.score_params = tuple(info["score_params"])
                self.max_prompt_tokens = info["max_prompt_tokens"]
                break
            else:
                raise DraftUnavailableError("no draft worker answers")
        return self._identity

    async def score(self, token_ids: list[int]) -> torch.Tensor:
        last_error: Exception | None = None
        for url in self._candidates():
            try:
                response = await self._client.post(
                    f"{url}/v1/score", json={"token_ids": token_ids}, headers=outgoing_headers()
                )
            except httpx.HTTPError as exc:
                self._mark_down(url, exc)
                last_error = exc
                continue
            if response.status_code >= 500:
                self._mark_down(url, RuntimeError(f"HTTP {response.status_code}"))
                last_error = RuntimeError(response.text)
                continue
            if response.status_code != 200:  # the prompt itself is the problem: no other worker will differ
                raise DraftUnavailableError(f"draft worker rejected the prompt: {response.text[:200]}")
            self._recent.add(token_ids, None)
            return scores_from_text(response.json()["scores"])
        raise DraftUnavailableError(f"no draft worker answered: {last_error!r}")

    def reusable_prefix(self, token_ids: Ints) -> int:
        """An estimate: workers are picked round-robin, so the prompt's prefix may sit on another worker."""
        found = self._recent.longest_shared(token_ids)
        return min(found[1], len(token_ids) - 1) if found is not None else 0

    def _candidates(self) -> list[str]:
        start = next(self._rotation)
        ordered = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        healthy = [u for u in ordered if self._down_until[u] <= now]
        return healthy or ordered  # all in cooldown: try them anyway rather than fail outright

    def _mark_down(self, url: str, exc: Exception) -> None:
        if self._down_until[url] <= time.monotonic():
            logger.warning(
                "draft worker %s failed (%s); skipping it for %.0f s", url, type(exc).__name__, self.cooldown
            )
        self._down_until[url] = time.monotonic() + self.cooldown

    async def infos(self) -> dict[str, dict[str, Any]]:
        """``/v1/info`` of every worker that answers now."""
        infos = {}
        for url in self.urls:
            try:
                infos[url] = (await self._client.get(f"{url}/v1/info", timeout=5.0)).raise_for_status().json()
            except httpx.HTTPError:
                continue
        return infos

    async def ready(self) -> bool:
        for url in self.urls:
            try:
                if (await self._client.get(f"{url}/health", timeout=2.0)).status_code == 200:
                    return True
            except httpx.HTTPError:
                continue
        return False

    async def close(self) -> None:
        await self._client.aclose()

"""Score caches: token scores (not selections, so any keep rate reuses them), stored as float32 bytes.

Values are plain little-endian float32 arrays: never pickles, readable from any language.
``get`` answers ``("hit", scores)``, ``("miss", None)`` or ``("off", None)`` when the cache cannot be used.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time
from typing import Protocol

import numpy as np
import torch

from draft_worker.codec import decode_scores, encode_scores

logger = logging.getLogger("specprefill.cache")


def score_key(prefix: str, draft_identity: str, score_params: tuple[int, ...], token_ids: list[int]) -> str:
    """Everything that changes scores: the draft's weights, look-ahead and pooling, the exact prompt tokens."""
    digest = hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()
    params = "-".join(str(p) for p in score_params)
    return f"{prefix}scores:{draft_identity}:{params}:{len(token_ids)}:{digest}"


class ScoreCache(Protocol):
    async def get(self, key: str) -> tuple[str, torch.Tensor | None]: ...

    async def put(self, key: str, scores: torch.Tensor) -> bool: ...

    async def close(self) -> None: ...


class MemoryScoreCache:
    """An in-process LRU bounded by bytes, with a TTL."""

    def __init__(self, max_bytes: int, ttl: float, max_entry_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.max_entry_bytes = max_entry_bytes
        self._entries: collections.OrderedDict[str, tuple[float, bytes]] = collections.OrderedDict()
        self._bytes = 0

    async def get(self, key: str) -> tuple[str, torch.Tensor | None]:
        entry = self._entries.get(key)
        if entry is None:
            return "miss", None
        expires, data = entry
        if expires < time.monotonic():
            self._drop(key)
            return "miss", None
        self._entries.move_to_end(key)
        return "hit", decode_scores(data)

    async def put(self, key: str, scores: torch.Tensor) -> bool:
        data = encode_scores(scores)
        if len(data) > self.max_entry_bytes or len(data) > self.max_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        self._entries[key] = (time.monotonic() + self.ttl, data)
        self._bytes += len(data)
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: str) -> None:
        _, data = self._entries.pop(key)
        self._bytes -= len(data)

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0


class RedisScoreCache:
    """Redis, shared by gateway replicas. Faults never fail a request: the cache reports ``off``.

    After an error the cache stays off for ``retry_after`` seconds (no request waits on a dead server),
    then tries again; redis-py reconnects by itself. One warning per outage, one line when it is back.
    """

    def __init__(self, url: str, ttl: float, max_entry_bytes: int, *, timeout: float = 0.5,
                 retry_after: float = 1.0) -> None:
        import redis.asyncio as redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.ttl = ttl
        self.max_entry_bytes = max_entry_bytes
        self.retry_after = retry_after
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._down_until = 0.0
        self._outage = False

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + self.retry_after
        if not self._outage:
            self._outage = True
            logger.warning("score cache: Redis unavailable (%s); serving without it until it returns",
                           type(exc).__name__)

    def _succeeded(self) -> None:
        if self._outage:
            self._outage = False
            logger.warning("score cache: Redis is back")

    async def get(self, key: str) -> tuple[str, torch.Tensor | None]:
        if not self._available():
            return "off", None
        try:
            data = await self._client.get(key)
        except Exception as exc:  # any Redis or network fault
            self._failed(exc)
            return "off", None
        self._succeeded()
        if data is None or len(data) % 4:
            return "miss", None
        return "hit", decode_scores(data)

    async def put(self, key: str, scores: torch.Tensor) -> bool:
        data = encode_scores(scores)
        if len(data) > self.max_entry_bytes or not self._available():
            return False
        try:
            await self._client.set(key, data, ex=max(1, int(self.ttl)))
        except Exception as exc:
            self._failed(exc)
            return False
        self._succeeded()
        return True

    async def close(self) -> None:
        await self._client.aclose()

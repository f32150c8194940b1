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
from gateway.engines.redis_link import RedisLink

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

    After an error the cache stays off for ``retry_after`` seconds, then tries again (``RedisLink``).
    """

    def __init__(
        self, url: str, ttl: float, max_entry_bytes: int, *, timeout: float = 0.5, retry_after: float = 1.0
    ) -> None:
        self.ttl = ttl
        self.max_entry_bytes = max_entry_bytes
        self.link = RedisLink(
            url, "score cache", "serving without it", logger, timeout=timeout, retry_after=retry_after
        )

    async def get(self, key: str) -> tuple[str, torch.Tensor | None]:
        if not self.link.available():
            return "off", None
        try:
            data = await self.link.client.get(key)
        except Exception as exc:  # any Redis or network fault
            self.link.failed(exc)
            return "off", None
        self.link.succeeded()
        if data is None or len(data) % 4:
            return "miss", None
        return "hit", decode_scores(data if isinstance(data, bytes) else data.encode())

    async def put(self, key: str, scores: torch.Tensor) -> bool:
        data = encode_scores(scores)
        if len(data) > self.max_entry_bytes or not self.link.available():
            return False
        try:
            await self.link.client.set(key, data, ex=max(1, int(self.ttl)))
        except Exception as exc:
            self.link.failed(exc)
            return False
        self.link.succeeded()
        return True

    async def close(self) -> None:
        await self.link.close()

"""The gateway's model of what the engine's prefix cache holds: the blocks it sent, by the engine's block size.

Blocks are keyed as the engine keys them (``engine.blocks``: tokens and positions, chained), kept LRU within
the engine's capacity. The model only predicts; a wrong guess costs time, never a wrong answer (answers that
report ``cached_tokens`` show how good the guesses are: ``specprefill_engine_cache_error_tokens``). In memory, or in Redis (one sorted set of block hashes by last use) so that gateway replicas in
front of one engine share it; Redis faults turn the model off (it predicts nothing cached), never a request.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from engine.blocks import BlockHasher, reusable_blocks

logger = logging.getLogger("specprefill.gateway")


class EngineCacheModel(Protocol):
    block_size: int
    max_blocks: int  # 0: the engine keeps nothing

    async def cached_tokens(self, token_ids: Sequence[int], position_ids: Sequence[int] | None) -> int: ...

    async def record(self, token_ids: Sequence[int], position_ids: Sequence[int] | None) -> None: ...

    async def close(self) -> None: ...


class MemoryEngineCache:
    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.block_size = block_size
        self.max_blocks = max(0, capacity_tokens // block_size)
        self._hashes = BlockHasher(block_size)  # a prompt is hashed when planned and again when recorded
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    async def cached_tokens(self, token_ids: Sequence[int], position_ids: Sequence[int] | None) -> int:
        hashes = self._hashes(token_ids, position_ids)
        hits = next((i for i, h in enumerate(hashes) if h not in self._blocks), len(hashes))
        return reusable_blocks(hits, len(token_ids), self.block_size) * self.block_size

    async def record(self, token_ids: Sequence[int], position_ids: Sequence[int] | None) -> None:
        """The engine has read ``token_ids`` at ``position_ids``: their full blocks are in its cache now."""
        hashes = self._hashes(token_ids, position_ids)
        for h in reversed(hashes):  # the head ends up the most recently used, as in the engine
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    async def close(self) -> None:
        self._blocks.clear()


class RedisEngineCache:
    """The same model in one Redis sorted set (block hash -> last use), shared by the gateway's replicas."""

    def __init__(self, url: str, key: str, block_size: int, capacity_tokens: int, *, timeout: float = 0.5,
                 retry_after: float = 1.0) -> None:
        import redis.asyncio as redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.block_size = block_size
        self.max_blocks = max(0, capacity_tokens // block_size)
        self._hashes = BlockHasher(block_size)
        self.key = key
        self.retry_after = retry_after
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._down_until = 0.0

    async def cached_tokens(self, token_ids: Sequence[int], position_ids: Sequence[int] | None) -> int:
        hashes = self._hashes(token_ids, position_ids)
        if not hashes or time.monotonic() < self._down_until:
            return 0
        try:
            scores = await self._client.zmscore(self.key, hashes)
        except Exception as exc:  # any Redis fault: predict nothing cached
            self._failed(exc)
            return 0
        hits = next((i for i, score in enumerate(scores) if score is None), len(hashes))
        return reusable_blocks(hits, len(token_ids), self.block_size) * self.block_size

    async def record(self, token_ids: Sequence[int], position_ids: Sequence[int] | None) -> None:
        hashes = self._hashes(token_ids, position_ids)
        if not hashes or time.monotonic() < self._down_until:
            return
        now = time.time()
        # the head most recent: later blocks slightly older, so trimming takes a chain's tail first
        members = {h: now - i * 1e-6 for i, h in enumerate(hashes)}
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zadd(self.key, members)
                pipe.zremrangebyrank(self.key, 0, -self.max_blocks - 1)
                await pipe.execute()
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        if time.monotonic() >= self._down_until:
            logger.warning("engine cache model: Redis unavailable (%s); predicting no cache hits until it returns",
                           type(exc).__name__)
        self._down_until = time.monotonic() + self.retry_after

    async def close(self) -> None:
        await self._client.aclose()

"""The gateway's model of what the engine's prefix cache holds, by the engine's block size.

Blocks are keyed as the engine keys them (``common.blocks``: tokens and non-default positions, chained). Two
sources:
  what the gateway sent (``MemoryEngineCache``, ``RedisEngineCache``): guessed, kept LRU within the engine's
  capacity; an answer that reports fewer cached tokens than predicted drops what was not there, and all that is
  older (``corrected``);
  in Redis (one sorted set of block hashes by last use) gateway replicas in front of one engine share it, and
  Redis faults turn the model off (it predicts nothing cached), never a request;
  what the engine says it stored and removed, from its KV cache events (``EventEngineCache``, fed by
  ``gateway.engines.kv_events``): known, not guessed.
The model only predicts; a wrong guess costs time, never a wrong answer (answers that report ``cached_tokens``
show how good the guesses are: ``specprefill_engine_cache_error_tokens``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from common.blocks import BlockHasher, Ints, block_hash, reusable_blocks
from gateway.engines.redis_link import RedisLink

logger = logging.getLogger("specprefill.gateway")


class EngineCacheModel(Protocol):
    block_size: int
    max_blocks: int  # 0: the engine keeps nothing

    async def cached_tokens(self, token_ids: Ints, position_ids: Ints | None) -> int: ...

    async def record(self, token_ids: Ints, position_ids: Ints | None) -> None: ...

    async def corrected(self, token_ids: Ints, position_ids: Ints | None, cached: int) -> None:
        """The engine served only ``cached`` leading tokens of this prompt from its cache: its blocks from there
        on were not there (before ``record`` puts the ones it has just computed back)."""

    async def close(self) -> None: ...


class MemoryEngineCache:
    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.block_size = block_size
        self.max_blocks = max(0, capacity_tokens // block_size)
        self._hashes = BlockHasher(block_size)  # a prompt is hashed when planned and again when recorded
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    async def cached_tokens(self, token_ids: Ints, position_ids: Ints | None) -> int:
        hashes = self._hashes(token_ids, position_ids)
        hits = next((i for i, h in enumerate(hashes) if h not in self._blocks), len(hashes))
        return reusable_blocks(hits, len(token_ids), self.block_size) * self.block_size

    async def record(self, token_ids: Ints, position_ids: Ints | None) -> None:
        """The engine has read ``token_ids`` at ``position_ids``: their full blocks are in its cache now."""
        hashes = self._hashes(token_ids, position_ids)
        for h in reversed(hashes):  # the head ends up the most recently used, as in the engine
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    async def corrected(self, token_ids: Ints, position_ids: Ints | None, cached: int) -> None:
        """The first block the engine did not have is gone, and, the engine evicting least recently used blocks
        first, so is every block used before it: all go from the model (a restart: most of it)."""
        hashes = self._hashes(token_ids, position_ids)
        missing = cached // self.block_size
        if missing >= len(hashes) or hashes[missing] not in self._blocks:
            return
        while self._blocks:
            h, _ = self._blocks.popitem(last=False)
            if h == hashes[missing]:
                break

    async def close(self) -> None:
        self._blocks.clear()


class RedisEngineCache:
    """The same model in one Redis sorted set (block hash -> last use), shared by the gateway's replicas."""

    def __init__(
        self,
        url: str,
        key: str,
        block_size: int,
        capacity_tokens: int,
        *,
        timeout: float = 0.5,
        retry_after: float = 1.0,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max(0, capacity_tokens // block_size)
        self._hashes = BlockHasher(block_size)
        self.key = key
        self.link = RedisLink(
            url, "engine cache model", "predicting no cache hits", logger, timeout=timeout, retry_after=retry_after
        )

    async def cached_tokens(self, token_ids: Ints, position_ids: Ints | None) -> int:
        hashes = self._hashes(token_ids, position_ids)
        if not hashes or not self.link.available():
            return 0
        try:
            scores = await self.link.client.zmscore(self.key, cast(list[str], hashes))  # bytes members, as stored
        except Exception as exc:  # any Redis fault: predict nothing cached
            self.link.failed(exc)
            return 0
        self.link.succeeded()
        hits = next((i for i, score in enumerate(scores) if score is None), len(hashes))
        return reusable_blocks(hits, len(token_ids), self.block_size) * self.block_size

    async def record(self, token_ids: Ints, position_ids: Ints | None) -> None:
        hashes = self._hashes(token_ids, position_ids)
        if not hashes or not self.link.available():
            return
        now = time.time()
        # the head most recent: later blocks slightly older, so trimming takes a chain's tail first
        members = {h: now - i * 1e-6 for i, h in enumerate(hashes)}
        try:
            async with self.link.client.pipeline(transaction=False) as pipe:
                pipe.zadd(self.key, members)
                pipe.zremrangebyrank(self.key, 0, -self.max_blocks - 1)
                await pipe.execute()
        except Exception as exc:
            self.link.failed(exc)

    async def corrected(self, token_ids: Ints, position_ids: Ints | None, cached: int) -> None:
        """As ``MemoryEngineCache.corrected``: the first missing block and every block used before it go."""
        hashes = self._hashes(token_ids, position_ids)
        missing = cached // self.block_size
        if missing >= len(hashes) or not self.link.available():
            return
        try:
            last_use = await self.link.client.zscore(self.key, hashes[missing])
            if last_use is not None:
                await self.link.client.zremrangebyscore(self.key, "-inf", last_use)
        except Exception as exc:
            self.link.failed(exc)

    async def close(self) -> None:
        await self.link.client.aclose()


class EventEngineCache:
    """What the engine's KV cache events say it holds. Blocks are known by the engine's own hashes in the events
    and by this gateway's hashes (``common.blocks``), worked out from each event's tokens, extra keys and parent.
    What the gateway has just sent counts as cached until its events come (they follow the engine's step), for
    ``confirm_s`` at most: a block no event confirms by then was not kept."""

    def __init__(
        self,
        block_size: int,
        capacity_tokens: int,
        *,
        confirm_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max(0, capacity_tokens // block_size)
        self.confirm_s = confirm_s
        self.clock = clock
        self._hashes = BlockHasher(block_size)
        self._ours: dict[object, bytes] = {}  # the engine's block hash -> ours
        self._theirs: dict[bytes, object] = {}  # ours -> the engine's
        self._pending: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # sent, not yet confirmed
        self.orphans = 0  # stored blocks whose parent this model never saw (events missed before it subscribed)

    @property
    def blocks(self) -> int:
        return len(self._theirs)

    async def cached_tokens(self, token_ids: Ints, position_ids: Ints | None) -> int:
        self._expire()
        hashes = self._hashes(token_ids, position_ids)
        hits = next((i for i, h in enumerate(hashes) if h not in self._theirs and h not in self._pending), len(hashes))
        return reusable_blocks(hits, len(token_ids), self.block_size) * self.block_size

    async def record(self, token_ids: Ints, position_ids: Ints | None) -> None:
        now = self.clock()
        for h in self._hashes(token_ids, position_ids):
            if h not in self._theirs:
                self._pending[h] = now
                self._pending.move_to_end(h)

    async def corrected(self, token_ids: Ints, position_ids: Ints | None, cached: int) -> None:
        pass  # the events say what is there

    def clear(self) -> None:
        self._ours.clear()
        self._theirs.clear()
        self._pending.clear()

    def stored(
        self,
        hashes: Sequence[Any],
        parent: object | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[Any] | None,
    ) -> int:
        """Blocks the engine stored (one ``BlockStored``); how many this model could place."""
        if block_size != self.block_size:  # the engine's own word on it, over a guess or a setting
            logger.info(
                "the engine's KV events come in blocks of %d tokens: the model's blocks were %d",
                block_size,
                self.block_size,
            )
            capacity = self.max_blocks * self.block_size
            self.clear()
            self.block_size, self.max_blocks = block_size, capacity // block_size
            self._hashes = BlockHasher(block_size)
        ours = b"" if parent is None else self._ours.get(parent)
        if ours is None:
            self.orphans += len(hashes)
            return 0
        for index, theirs in enumerate(hashes):
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            ours = block_hash(ours, tokens, extra_keys[index] if extra_keys else None)
            if (old := self._theirs.get(ours)) is not None and old != theirs:
                self._ours.pop(old, None)
            self._ours[theirs] = ours
            self._theirs[ours] = theirs
            self._pending.pop(ours, None)
        return len(hashes)

    def removed(self, hashes: Sequence[Any]) -> None:
        for theirs in hashes:
            ours = self._ours.pop(theirs, None)
            if ours is not None:
                self._theirs.pop(ours, None)

    def _expire(self) -> None:
        deadline = self.clock() - self.confirm_s
        while self._pending and next(iter(self._pending.values())) < deadline:
            self._pending.popitem(last=False)

    async def close(self) -> None:
        self.clear()

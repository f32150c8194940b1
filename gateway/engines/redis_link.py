"""One Redis connection for a cache that must never fail a request: the score cache and the engine-cache model.

A fault makes the link unavailable for ``retry_after`` seconds (no request waits on a dead server), then it is
tried again. A connection that broke while Redis stayed up (a request cancelled mid-command leaves its pooled
connection half-read; seen as "Redis unavailable (ConnectionError)" at an engine fault, with Redis up) is
reconnected and the command retried once, at once (with redis.asyncio's own ``Retry``: the synchronous one, used
before, never retried an awaited command). One warning when an outage begins, one line when Redis is back.
"""

from __future__ import annotations

import logging
import time


class RedisLink:
    def __init__(
        self, url: str, name: str, without: str, log: logging.Logger, *, timeout: float = 0.5, retry_after: float = 1.0
    ) -> None:
        """``name``: who uses it, in ``log``; ``without``: what it does while Redis is down."""
        import redis.asyncio as redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        self.name = name
        self.log = log
        self.without = without
        self.retry_after = retry_after
        # one retry on a fresh connection, for a stale pooled one; timeouts are not retried (Redis is slow or gone)
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            health_check_interval=0,
        )
        self._down_until = 0.0
        self.outage = False

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, exc: Exception) -> None:
        self._down_until = time.monotonic() + self.retry_after
        if not self.outage:
            self.outage = True
            self.log.warning(
                "%s: Redis unavailable (%s); %s until it returns", self.name, type(exc).__name__, self.without
            )

    def succeeded(self) -> None:
        if self.outage:
            self.outage = False
            self.log.warning("%s: Redis is back", self.name)

    async def close(self) -> None:
        await self.client.aclose()

"""Replicas: the engines that serve the model (``--backend-url`` given more than once), each with what the gateway
knows of it: its prefix cache (a model, followed from its KV events where it publishes them), its load, its
warming and its health.

Each request goes to the replica where its best plan costs least (``gateway.planning.routing``); a replica
that refuses connections or fails its health check is taken out until it answers again, and a request it
dropped before its first event goes to another (``gateway.dispatch.dispatcher``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.engines.backends import Backend
from gateway.engines.cache import EngineCacheModel
from gateway.engines.kv_events import EventSubscriber
from gateway.engines.load import EngineLoad

logger = logging.getLogger("specprefill.gateway")


class Warming(Protocol):
    """Background work that puts a recurring context in the engine's prefix cache (``gateway.planning.warming``)."""

    def offer(self, token_ids: Sequence[int]) -> None: ...

    async def close(self) -> None: ...


@dataclass(eq=False)
class Replica:
    """One engine serving the model, and what the gateway knows of it."""

    index: int  # its place in --backend-url (Server-Timing's ``replica``)
    name: str  # its base URL, or "in-process"
    backend: Backend
    load: EngineLoad
    cache: EngineCacheModel | None = None  # None: plan as if it kept nothing (text backends)
    events: EventSubscriber | None = None
    warmer: Warming | None = None
    up: bool = True
    routed: int = 0  # when a request last went to it (a count of routed requests): ties go to the longest idle

    def down(self, reason: str) -> None:
        if self.up:
            logger.warning("replica %s is out: %s", self.name, reason)
        self.up = False

    async def close(self) -> None:
        if self.warmer is not None:
            await self.warmer.close()
        if self.events is not None:
            await self.events.close()
        await self.load.close()
        if self.backend is not None:
            await self.backend.close()
        if self.cache is not None:
            await self.cache.close()


class HealthWatch:
    """Asks every replica's backend whether it is ready every ``interval`` seconds: one that is not is out of the
    routing until it is again (a replica back from a restart has an empty cache: with KV events its model
    follows, and without them the first answers correct it)."""

    def __init__(self, replicas: list[Replica], interval: float) -> None:
        self.replicas = replicas
        self.interval = interval
        self._task: asyncio.Task[Any] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()

    async def check(self) -> None:
        ready = await asyncio.gather(*(self._ready(r) for r in self.replicas))
        for replica, ok in zip(self.replicas, ready):
            if ok == replica.up:
                continue
            if ok:
                logger.info("replica %s is back", replica.name)
                replica.up = True
            else:
                replica.down("its health check failed")

    @staticmethod
    async def _ready(replica: Replica) -> bool:
        try:
            return bool(await asyncio.wait_for(replica.backend.ready(), 5.0))
        except Exception:  # a health check that fails says the replica is not ready
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

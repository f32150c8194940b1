"""Warming: after a compressed request, the whole prompt goes to the engine in the background.

The next request on that context (a chat's next turn, the same document with a new question, the next user
of a shared system prompt) then finds the whole prompt in the engine's prefix cache and goes whole at the
price of its new tokens, reading the full context. Warming yields to real traffic: it starts only when no
request of this gateway is at the backend, at the lowest priority where the engine has priorities, at most
``concurrency`` at a time, and a foreground request cancels it (what the engine computed stays in its cache).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.metrics import GatewayMetrics
from gateway.plan import Plan

logger = logging.getLogger("specprefill.gateway")


class Warmer:
    def __init__(self, send: Callable[[list[int]], Awaitable[dict]], completed: Callable, metrics: GatewayMetrics,
                 *, concurrency: int = 1) -> None:
        self.send = send  # one token for these prompt tokens; answers the completion (with its usage)
        self.completed = completed  # Planner.completed
        self.metrics = metrics
        self.concurrency = concurrency
        self._tasks: set[asyncio.Task] = set()

    def maybe_warm(self, plan: Plan, foreground: int) -> None:
        """Warms ``plan``'s whole prompt if the backend is idle (``foreground`` requests under way)."""
        if foreground > 0 or len(self._tasks) >= self.concurrency:
            self.metrics.warming.labels("skipped_busy").inc()
            return
        self.metrics.in_flight.labels("warm").inc()  # from now: a watcher never sees an idle gap before it
        task = asyncio.ensure_future(self._warm(plan.token_ids))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self.metrics.in_flight.labels("warm").dec()

    def yield_to_foreground(self) -> None:
        for task in list(self._tasks):
            if task.cancel():
                self.metrics.warming.labels("cancelled").inc()

    async def _warm(self, token_ids: list[int]) -> None:
        self.metrics.warming.labels("started").inc()
        start = time.perf_counter()
        try:
            answer = await self.send(token_ids)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a warm is optional: its failure is a log line, never an error
            self.metrics.warming.labels("failed").inc()
            logger.warning("warming failed: %s", type(exc).__name__)
            return
        self.metrics.warming.labels("done").inc()
        await self.completed(Plan(token_ids, kind="warm"), answer.get("usage"), time.perf_counter() - start)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

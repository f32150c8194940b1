"""Warming: after a compressed request on a recurring context, its whole prompt goes to the engine in the
background, in pieces, in the engine's idle time.

The next request on that context (a chat's next turn, the same document with a new question, the next user of
a shared system prompt) then finds the prompt in the engine's prefix cache and can go whole at the price of its
new tokens. Each piece is one short request through the engine's normal API that extends what the engine
already holds (``prompt[:end]``, one token; about ``piece_s`` of engine time, at least one cache block), so:
  a request that arrives during a warm waits for at most one piece (an engine runs what it has first, and
  cancelling a request does not stop a forward already under way);
  a piece starts only where the engine is idle, no one else's request is there, and the gateway's recent idle
  gaps say the next request most likely comes after the piece ends (``EngineLoad.quiet_for``): back-to-back
  traffic is never warmed, traffic with think time is warmed within it;
  what each piece computed is recorded as it lands, so a warm interrupted by traffic resumes where it stopped,
  and the planner counts on what has landed, never on what is still to come.
Where one block takes the engine longer than ``piece_s`` (a CPU engine on a long prompt) and the engine is likely
to stay quiet for twice that long (a pause, or a think time the recent gaps show), ``--warming-quiet-blocks N``
lets a piece take N blocks' time. On vLLM's CPU build a 128-token block on 24,000 cached tokens took 2.8 s, about
0.7 s of it the request's own cost, and 8,192 tokens went in 67 s in 512-token pieces against 56 s in 2,048-token
ones; but a request that meets a larger piece waits for all of it (a Claude Code turn waited 4.4 s behind a
4-block piece), so the default stays one block.
Pieces carry a low ``priority``: vLLM under ``--scheduling-policy priority`` and the reference engine let any
request overtake a waiting piece (vLLM under its default first-come-first-served policy ignores the field).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from common.errors import APIError
from gateway.engines.cache import EngineCacheModel
from gateway.engines.load import EngineLoad
from gateway.metrics import GatewayMetrics
from gateway.planning.costs import CostModel
from gateway.planning.plan import Plan

logger = logging.getLogger("specprefill.gateway")
SAFETY = 2.0  # a piece needs an idle window of twice its predicted time: predictions are within 2x
QUIET_BLOCKS = 1  # a piece's blocks' time in a quiet window where one block takes longer than piece_s (an option)


class Warmer:
    def __init__(
        self,
        send: Callable[[Sequence[int], int | None], Awaitable[dict[str, Any]]],
        landed: Callable[..., Any],
        load: EngineLoad,
        cache: EngineCacheModel,
        cost: CostModel,
        metrics: GatewayMetrics,
        *,
        piece_s: float = 0.1,
        priority: int | None = 10,
        confidence: float = 0.9,
        max_jobs: int = 4,
        recheck_s: float = 0.05,
        quiet_blocks: int = QUIET_BLOCKS,
    ) -> None:
        self.send = send  # (prompt tokens, priority) -> the one-token completion answer, with its usage
        self.landed = landed  # Planner.completed
        self.load = load
        self.cache = cache
        self.cost = cost
        self.metrics = metrics
        self.piece_s = piece_s
        self.priority = priority or None
        self.confidence = confidence
        self.max_jobs = max_jobs
        self.recheck_s = recheck_s
        self.quiet_blocks = quiet_blocks
        self._jobs: list[tuple[int, ...]] = []  # prompts to warm, the newest last
        self._next: tuple[tuple[int, ...], int, float] | None = None  # the piece to send when the engine is quiet
        self._task: asyncio.Task[Any] | None = None

    def offer(self, token_ids: Sequence[int]) -> None:
        """Warms the whole prompt ``token_ids`` when the engine has time. A prompt that begins with an earlier job's
        (the chat's next turn) replaces it; the oldest job goes past ``max_jobs``."""
        prompt = tuple(token_ids)  # jobs are tuples: a plan's tokens and a rendered next turn compare alike
        if len(prompt) > self.cache.max_blocks * self.cache.block_size:
            return  # more than the engine keeps: it would evict its own head
        kept = []
        for job in self._jobs:
            if len(job) <= len(prompt) and prompt[: len(job)] == job:
                self.metrics.warming.labels("superseded").inc()
            elif len(prompt) <= len(job) and job[: len(prompt)] == prompt:
                return  # already on its way
            else:
                kept.append(job)
        self._jobs = [*kept, prompt][-self.max_jobs :]
        self._next = None
        self.metrics.warming_pending.set(len(self._jobs))
        self.metrics.warming.labels("offered").inc()
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while self._jobs:
            if not self.load.idle:
                self._next = None  # what the engine holds may change meanwhile
                await self.load.changed(1.0)
                continue
            if self._next is None and (piece := await self._next_piece()) is not None:
                self._next = piece
            if self._next is None:
                continue
            job, end, predicted = self._next
            if not self.load.quiet_for(SAFETY * predicted, self.confidence):
                await self.load.changed(self.recheck_s)
                continue
            self._next = None
            if not await self._piece(job[:end], predicted):
                self._drop(job)

    def _drop(self, job: tuple[int, ...]) -> None:
        if job in self._jobs:
            self._jobs.remove(job)
        self.metrics.warming_pending.set(len(self._jobs))

    async def _next_piece(self) -> tuple[tuple[int, ...], int, float] | None:
        """The newest job's next piece (its prompt, where the piece ends, its predicted time), from what the
        engine holds of it; None when the job is done (it is dropped)."""
        job = self._jobs[-1]
        start = await self.cache.cached_tokens(job, None)
        if start >= (len(job) - 1) // self.cache.block_size * self.cache.block_size:
            self._drop(job)
            self.metrics.warming.labels("done").inc()
            return None
        end = self._piece_end(len(job), start, self._budget(start))
        return job, end, self.cost.predict(end - start, start)

    def _budget(self, start: int) -> float:
        """A piece's engine time from ``start``: ``piece_s``, or ``quiet_blocks`` blocks' where one block takes
        longer and the engine is likely to stay quiet for twice that (a pause, or a think time under way)."""
        large = self.quiet_blocks * self.cost.predict(self.cache.block_size, start)
        if large > self.piece_s and self.load.quiet_for(SAFETY * large, self.confidence):
            return large
        return self.piece_s

    def _piece_end(self, n: int, start: int, budget: float) -> int:
        """Where the next piece ends: the most whole blocks after ``start`` whose predicted time is within
        ``budget`` (one block at least); the rest of the prompt if that is within one more piece."""
        block = self.cache.block_size
        blocks, low, high = 1, 1, max(1, (n - start) // block)
        while low <= high:  # predicted time grows with the piece: the largest that fits
            middle = (low + high) // 2
            if self.cost.predict(middle * block, start) <= budget:
                blocks, low = middle, middle + 1
            else:
                high = middle - 1
        end = start + blocks * block
        return n if end + block > n else end

    async def _piece(self, prompt: Sequence[int], predicted: float) -> bool:
        """One piece; False if the warm should stop (the backend refused it)."""
        ticket = self.load.begin(predicted, background=True)
        self.metrics.in_flight.labels("warm").inc()
        start = time.perf_counter()
        try:
            answer = await self._send(prompt)
        except Exception as exc:  # a warm is optional: its failure is a log line, never an error
            self.metrics.warming.labels("failed").inc()
            logger.warning("warming failed: %s", type(exc).__name__ + (f": {exc}" if str(exc) else ""))
            return False
        finally:
            self.load.answered(ticket)
            self.load.end(ticket)
            self.metrics.in_flight.labels("warm").dec()
        self.metrics.warming.labels("piece").inc()
        await self.landed(
            Plan(prompt, kind="warm"), answer.get("usage"), time.perf_counter() - start, contended=ticket.contended
        )
        return True

    async def _send(self, prompt: Sequence[int]) -> dict[str, Any]:
        try:
            return await self.send(prompt, self.priority)
        except APIError as exc:  # an engine without priorities that refuses the field: send none from now on
            if self.priority is None or exc.status_code != 400 or "priority" not in exc.message.lower():
                raise
            logger.info("the backend refuses request priorities; warming pieces go without one")
            self.priority = None
            return await self.send(prompt, None)

    async def close(self) -> None:
        self._jobs.clear()
        self.metrics.warming_pending.set(0)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

"""Feedback: what an answered request teaches. The backend's usage is read from its answer or its stream (what
the engine's cache served), the planner learns the plan's outcome, and a compressed recurring context is offered
for warming (and, once the client's answer is in, the start of its next turn in its place); the request counts as
at its replica until then."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from gateway.dispatch.answer import Endpoint
from gateway.dispatch.trace import Trace
from gateway.engines.load import Ticket
from gateway.metrics import GatewayMetrics
from gateway.planning.plan import Plan
from gateway.planning.planner import Planner

logger = logging.getLogger("specprefill.gateway")


class Feedback:
    def __init__(self, planner: Planner, metrics: GatewayMetrics, foreground: Callable[..., Any]) -> None:
        self.planner = planner
        self.metrics = metrics
        self._foreground = foreground  # the dispatcher's count of its requests at a replica
        self._settling: set[asyncio.Task[None]] = set()  # streams' ends being recorded

    async def close(self) -> None:
        await asyncio.gather(*self._settling, return_exceptions=True)

    async def observed(
        self,
        chunks: AsyncGenerator[dict[str, Any], None],
        trace: Trace,
        ticket: Ticket,
        endpoint: Endpoint,
        wants_usage: bool,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The backend's stream, its usage kept for the planner (and hidden from a client that did not ask).
        The stream opened with the backend's first event, so the engine holds the prompt whether or not the
        client reads to the end: the planner learns either way (the usage, if it came, says what was cached)."""
        usage = None
        try:
            async for chunk in chunks:
                usage = endpoint.usage(chunk) or usage
                if endpoint.asks_usage and not wants_usage:
                    if not chunk.get("choices"):
                        continue
                    chunk.pop("usage", None)
                yield chunk
        finally:
            # a task: a client's disconnect cancels this generator, and an await here would be cancelled too
            task = asyncio.ensure_future(self.settle(trace, ticket, usage, chunks))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def settle(
        self,
        trace: Trace,
        ticket: Ticket,
        usage: dict[str, Any] | None,
        chunks: AsyncGenerator[dict[str, Any], None] | None = None,
    ) -> None:
        """The end of a backend request: the stream closed (the backend stops generating for a client that
        left), the planner told, and a recurring context offered for warming. The request counts as under way
        until then, so that no one watching sees the backend idle in between."""
        try:
            if chunks is not None:
                await chunks.aclose()
            await self._answered(trace, usage, ticket.contended)
        finally:
            trace.plan.placed.load.end(ticket)
            self._foreground(trace.plan.placed.load, -1)

    async def _answered(self, trace: Trace, usage: dict[str, Any] | None, contended: bool) -> None:
        """The planner learns from an answered request; a compressed recurring context is offered for warming."""
        plan = trace.plan
        try:
            await self.planner.completed(plan, usage, trace.backend_ms / 1e3, contended=contended)
        except Exception:  # learning is best effort: never an error for the client
            logger.exception("could not record the plan's outcome")
        if self.warms(plan) and (warmer := plan.placed.warmer) is not None:
            warmer.offer(plan.token_ids)

    @staticmethod
    def warms(plan: Plan) -> bool:
        """Whether the engine is to hold the whole of what ``plan`` compressed: a context likely to come back."""
        return (
            plan.replica is not None
            and plan.replica.warmer is not None
            and plan.status == "compressed"
            and plan.recurring
        )

    def next_turn(self, plan: Plan, render: Callable[[], list[int] | None]) -> None:
        """A warmed plan's answer is in: ``render()`` is the prompt the client's next turn begins with (this one,
        then the answer as the client sends it back), offered for warming in place of this prompt alone. Rendered
        on a worker thread: a long chat takes milliseconds."""
        if self.warms(plan):
            task = asyncio.ensure_future(self._offer_next(plan, render))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _offer_next(self, plan: Plan, render: Callable[[], list[int] | None]) -> None:
        try:
            token_ids = await asyncio.to_thread(render)
        except Exception as exc:  # an answer the gateway cannot render: the prompt alone is warmed
            logger.debug("the next turn's start could not be rendered: %s", exc)
            return
        if token_ids and (warmer := plan.placed.warmer) is not None:
            warmer.offer(token_ids)

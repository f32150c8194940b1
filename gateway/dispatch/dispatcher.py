"""Dispatch: a plan taken to a replica. The backend request is sent there (a replica that drops it before its
first event is taken out and the request goes to another, by the one routing rule), counted in the replica's
load from its send to its settling, and timed in the request's ``Trace``; the answer's end goes to
``Feedback``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from common.tracing import span
from gateway.dispatch.answer import Answer, Endpoint
from gateway.dispatch.feedback import Feedback
from gateway.dispatch.trace import Trace
from gateway.engines.backends import Backend, BackendGone
from gateway.engines.load import EngineLoad, Ticket
from gateway.engines.replicas import Replica
from gateway.metrics import GatewayMetrics
from gateway.planning.plan import Plan
from gateway.planning.planner import Planner
from gateway.planning.routing import Router

logger = logging.getLogger("specprefill.gateway")
T = TypeVar("T")
# loop steps a backend request takes to reach the socket on a kept-alive connection (aiohttp 3.14 on Python 3.11
# writes the request in a task of its own, started by the send: 2 steps, asyncio's loop or uvloop; a new
# connection's takes about 7 on loopback, and is then written once the plan is made)
SEND_STEPS = 2
Planning = Callable[[], Awaitable[tuple[Plan, Any]]]  # a request's plan (and its prompt), made when called


class Dispatcher:
    def __init__(self, planner: Planner, router: Router, metrics: GatewayMetrics) -> None:
        self.planner = planner
        self.router = router
        self.metrics = metrics
        self.replicas = planner.replicas
        self.feedback = Feedback(planner, metrics, self._foreground)

    async def close(self) -> None:
        await self.feedback.close()

    async def forward(
        self, plan: Plan, body: dict[str, Any], endpoint: Endpoint, *, planning: Planning | None = None
    ) -> Answer:
        """Sends ``body`` to the backend's ``endpoint`` at the plan's replica; the answer as the backend gave
        it (the API surface shapes it for its client). When it is answered, the planner learns what happened.
        A replica that drops the request before its first event (refused, or gone mid-prefill: the client has
        seen nothing) is taken out, and the request goes to another. ``planning``: the plan of a request sent
        before it was made (``plan`` holds only its replica), made while the backend reads the prompt."""
        streamed = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) or not streamed
        if streamed and endpoint.asks_usage:  # ask for the usage: it says what the engine's cache served
            body = {**body, "stream_options": {"include_usage": True}}
        if plan.replica is None:  # a plan the planner did not make (a request whose prompt is not read)
            plan = await self.router.place(plan)
        trace, path = Trace(plan), endpoint.path
        if streamed:
            stream, ticket = await self._delivered(trace, lambda backend: backend.stream(path, body), planning)
            return Answer(trace, stream=self.feedback.observed(stream, trace, ticket, endpoint, wants_usage))
        answer, ticket = await self._delivered(trace, lambda backend: backend.post(path, body), planning)
        await self.feedback.settle(trace, ticket, endpoint.usage(answer))
        return Answer(trace, body=answer)

    async def _delivered(
        self, trace: Trace, send: Callable[[Backend], Awaitable[T]], planning: Planning | None = None
    ) -> tuple[T, Ticket]:
        """``send`` at the trace's replica, up to its first event; at another (``trace.plan`` then priced there)
        where a replica drops it before then. Its answer and its load ticket."""
        tried = set()
        while True:
            replica = trace.plan.placed
            tried.add(replica)
            try:
                answer, ticket = await self._sent(trace, replica, send, planning)
                break
            except BackendGone as exc:
                planning = None  # made by then: the backend's first event is awaited after the plan
                others = [r for r in self.replicas if r.up and r not in tried]
                if not others:
                    raise
                replica.down(exc.message)
                self.metrics.failovers.inc()
                trace.plan = await self.router.place(trace.plan, others)
        if ticket.behind:
            self.metrics.behind_background.observe(trace.background_ms / 1e3)
        return answer, ticket

    async def _sent(
        self,
        trace: Trace,
        replica: Replica,
        send: Callable[[Backend], Awaitable[T]],
        planning: Planning | None = None,
    ) -> tuple[T, Ticket]:
        """``send`` at ``replica``, up to its first event: the answer (a stream is open) and its load ticket."""
        load = replica.load
        self.metrics.routed.labels(str(replica.index)).inc()
        self._foreground(load, +1)
        if planning is None:
            # what the engine holds ahead of it now, after the draft (requests planned meanwhile went first)
            self._priced(trace, load, None)
        ticket = load.begin(trace.plan.target_s, expected_s=trace.expected_s)
        start = time.perf_counter()
        try:
            with span("specprefill.backend", **{"specprefill.replica": replica.index}):
                if planning is None:
                    answer = await send(replica.backend)  # up to the first event: the engine's TTFT as seen here
                else:
                    answer = await self._planned_meanwhile(trace, load, ticket, send(replica.backend), planning)
        except BaseException:
            load.end(ticket)
            self._foreground(load, -1)
            raise
        finally:
            trace.backend_ms = (time.perf_counter() - start) * 1e3
        trace.background_ms = load.answered(ticket) * 1e3
        return answer, ticket

    @staticmethod
    def _priced(trace: Trace, load: EngineLoad, ticket: Ticket | None) -> None:
        """The trace's plan priced at ``load``: the wait ahead of it, its predicted and expected backend times
        (``ticket``: its own, begun before the plan was made, then priced)."""
        wait, predicted, expected = load.estimate(trace.plan.target_s)
        trace.wait_ms, trace.predicted_ms, trace.expected_s = wait * 1e3, predicted * 1e3, expected
        if ticket is not None:
            ticket.predicted_s, ticket.expected_s = trace.plan.target_s, expected

    async def _planned_meanwhile(
        self, trace: Trace, load: EngineLoad, ticket: Ticket, sending: Awaitable[T], planning: Planning
    ) -> T:
        """``sending`` started, then the trace's plan made (``planning``) while the backend reads the prompt, then
        its answer up to the first event. A plan that fails (a client's 4xx) ends the request at the backend."""
        task = asyncio.ensure_future(sending)
        try:
            for _ in range(SEND_STEPS):  # the request written to the backend before the plan's work
                await asyncio.sleep(0)
            trace.plan = (await planning())[0].but(replica=trace.plan.placed)
            self._priced(trace, load, ticket)
            return await task
        except BaseException:
            await _abandoned(task)
            raise

    def _foreground(self, load: EngineLoad, delta: int) -> None:
        """A request of this gateway at a replica (+1) or done there (-1)."""
        if delta > 0:
            load.enter()
        else:
            load.leave()
        self.metrics.in_flight.labels("foreground").inc(delta)


async def _abandoned(task: asyncio.Future[Any]) -> None:
    """A send no one will read: cancelled, or, where it got its answer already, that answer's stream closed."""
    task.cancel()
    try:
        answer = await task
    except BaseException:
        return
    close = getattr(answer, "aclose", None)
    if close is not None:
        await close()

"""Dispatch: a plan taken to a replica. The backend request is sent there (a replica that drops it before its
first event is taken out and the request goes to another, by the one routing rule), counted in the replica's
load from its send to its settling, and timed in the request's ``Trace``; the answer's end goes to
``Feedback``."""

from __future__ import annotations

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


class Dispatcher:
    def __init__(self, planner: Planner, router: Router, metrics: GatewayMetrics) -> None:
        self.planner = planner
        self.router = router
        self.metrics = metrics
        self.replicas = planner.replicas
        self.feedback = Feedback(planner, metrics, self._foreground)

    async def close(self) -> None:
        await self.feedback.close()

    async def forward(self, plan: Plan, body: dict[str, Any], endpoint: Endpoint) -> Answer:
        """Sends ``body`` to the backend's ``endpoint`` at the plan's replica; the answer as the backend gave
        it (the API surface shapes it for its client). When it is answered, the planner learns what happened.
        A replica that drops the request before its first event (refused, or gone mid-prefill: the client has
        seen nothing) is taken out, and the request goes to another."""
        streamed = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) or not streamed
        if streamed and endpoint.asks_usage:  # ask for the usage: it says what the engine's cache served
            body = {**body, "stream_options": {"include_usage": True}}
        if plan.replica is None:  # a plan the planner did not make (a request whose prompt is not read)
            plan = await self.router.place(plan)
        trace, path = Trace(plan), endpoint.path
        if streamed:
            stream, ticket = await self._delivered(trace, lambda backend: backend.stream(path, body))
            return Answer(trace, stream=self.feedback.observed(stream, trace, ticket, endpoint, wants_usage))
        answer, ticket = await self._delivered(trace, lambda backend: backend.post(path, body))
        await self.feedback.settle(trace, ticket, endpoint.usage(answer))
        return Answer(trace, body=answer)

    async def _delivered(self, trace: Trace, send: Callable[[Backend], Awaitable[T]]) -> tuple[T, Ticket]:
        """``send`` at the trace's replica, up to its first event; at another (``trace.plan`` then priced there)
        where a replica drops it before then. Its answer and its load ticket."""
        tried = set()
        while True:
            replica = trace.plan.placed
            tried.add(replica)
            try:
                answer, ticket = await self._sent(trace, replica, send)
                break
            except BackendGone as exc:
                others = [r for r in self.replicas if r.up and r not in tried]
                if not others:
                    raise
                replica.down(exc.message)
                self.metrics.failovers.inc()
                trace.plan = await self.router.place(trace.plan, others)
        if ticket.behind:
            self.metrics.behind_background.observe(trace.background_ms / 1e3)
        return answer, ticket

    async def _sent(self, trace: Trace, replica: Replica, send: Callable[[Backend], Awaitable[T]]) -> tuple[T, Ticket]:
        """``send`` at ``replica``, up to its first event: the answer (a stream is open) and its load ticket."""
        load = replica.load
        self.metrics.routed.labels(str(replica.index)).inc()
        self._foreground(load, +1)
        # what the engine holds ahead of it now, after the draft (requests planned meanwhile went first)
        wait, predicted, expected = load.estimate(trace.plan.target_s)
        trace.wait_ms, trace.predicted_ms = wait * 1e3, predicted * 1e3
        ticket = load.begin(trace.plan.target_s, expected_s=expected)
        start = time.perf_counter()
        try:
            with span("specprefill.backend", **{"specprefill.replica": replica.index}):
                answer = await send(replica.backend)  # up to the first event: the engine's TTFT as seen here
        except BaseException:
            load.end(ticket)
            self._foreground(load, -1)
            raise
        finally:
            trace.backend_ms = (time.perf_counter() - start) * 1e3
        trace.background_ms = load.answered(ticket) * 1e3
        return answer, ticket

    def _foreground(self, load: EngineLoad, delta: int) -> None:
        """A request of this gateway at a replica (+1) or done there (-1)."""
        if delta > 0:
            load.enter()
        else:
            load.leave()
        self.metrics.in_flight.labels("foreground").inc(delta)

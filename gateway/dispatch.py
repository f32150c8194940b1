"""Dispatch: a plan taken to a replica. The backend request is sent there (a replica that drops it before its
first event is taken out and the request goes to another), counted in the replica's load from its send to its
settling, and timed; the answer's end goes to ``Feedback``."""

from __future__ import annotations

import logging
import time

from gateway.answer import CHAT, COMPLETIONS, Answer
from gateway.backends import Backend, BackendGone
from gateway.feedback import Feedback
from gateway.metrics import GatewayMetrics
from gateway.plan import Plan
from gateway.planner import Planner
from gateway.replicas import Replica

logger = logging.getLogger("specprefill.gateway")


class Dispatcher:
    def __init__(self, planner: Planner, metrics: GatewayMetrics) -> None:
        self.planner = planner
        self.metrics = metrics
        self.replicas = planner.replicas
        self.feedback = Feedback(planner, metrics, self._foreground)

    async def close(self) -> None:
        await self.feedback.close()

    async def forward(self, plan: Plan, body: dict, path: str) -> Answer:
        """Sends ``body`` to the backend's endpoint ``path`` at the plan's replica; the answer as the backend gave
        it (the API surface shapes it for its client). When it is answered, the planner learns what happened.
        A replica that drops the request before its first event (refused, or gone mid-prefill: the client has
        seen nothing) is taken out, and the request goes to another."""
        streamed = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) or not streamed
        if streamed and path in (CHAT, COMPLETIONS):  # ask for the usage: it says what the engine's cache served
            body = {**body, "stream_options": {"include_usage": True}}
        plan.replica = plan.replica or min(self.replicas, key=lambda r: (not r.up, r.load.outstanding))
        tried = set()
        while True:
            replica = plan.replica
            tried.add(replica)
            try:
                answer, ticket = await self._sent(plan, replica, path, body, streamed)
                break
            except BackendGone as exc:
                others = [r for r in self.replicas if r.up and r not in tried]
                if not others:
                    raise
                replica.down(exc.message)
                self.metrics.failovers.inc()
                plan.replica = min(others, key=lambda r: r.load.outstanding)
                await self.planner.priced(plan)
        if ticket.behind:
            self.metrics.behind_background.observe(plan.background_ms / 1e3)
        if streamed:
            return Answer(
                plan,
                stream=self.feedback.observed(answer, plan, ticket, wants_usage or path not in (CHAT, COMPLETIONS)),
            )
        await self.feedback.settle(plan, ticket, answer.get("usage"))
        return Answer(plan, body=answer)

    async def _sent(self, plan: Plan, replica: Replica, path: str, body: dict, streamed: bool):
        """``body`` at ``replica``, up to its first event: the answer (a stream is open) and its load ticket."""
        load = replica.load
        self.metrics.routed.labels(str(replica.index)).inc()
        self._foreground(load, +1)
        # what the engine holds ahead of it now, after the draft (requests planned meanwhile went first)
        wait, predicted, expected = load.estimate(plan.target_s)
        plan.wait_ms, plan.predicted_ms = wait * 1e3, predicted * 1e3
        ticket = load.begin(plan.target_s, expected_s=expected)
        try:
            answer = await self._timed(plan, self._call(replica.backend, path, body, streamed))
        except BaseException:
            load.end(ticket)
            self._foreground(load, -1)
            raise
        plan.background_ms = load.answered(ticket) * 1e3
        return answer, ticket

    @staticmethod
    def _call(backend: Backend, path: str, body: dict, streamed: bool):
        if path == CHAT:
            return backend.chat_stream(body) if streamed else backend.chat(body)
        if path == COMPLETIONS:
            return backend.completion_stream(body) if streamed else backend.completion(body)
        return backend.stream(path, body) if streamed else backend.post(path, body)

    def _foreground(self, load, delta: int) -> None:
        """A request of this gateway at a replica (+1) or done there (-1)."""
        if delta > 0:
            load.enter()
        else:
            load.leave()
        self.metrics.in_flight.labels("foreground").inc(delta)

    @staticmethod
    async def _timed(plan: Plan, call):
        """Awaits a backend call (a stream is opened up to its first event) and records how long it took."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            plan.backend_ms = (time.perf_counter() - start) * 1e3

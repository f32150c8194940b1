"""A backend's answer as the gateway passes it on (whole or streamed, with its plan), and the backend endpoints
it comes from."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.plan import Plan

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"


@dataclass(slots=True)
class Answer:
    plan: Plan
    body: dict | None = None
    stream: AsyncIterator[dict] | None = None

    def map(self, body: Callable[[dict], dict], stream: Callable[[AsyncIterator[dict]], AsyncIterator[dict]]) -> Answer:
        """This answer in another shape: ``body`` for a whole one, ``stream`` for a streamed one."""
        if self.stream is not None:
            return Answer(self.plan, stream=stream(self.stream))
        return Answer(self.plan, body=body(self.body))

"""A backend's answer as the gateway passes it on (whole or streamed, with its plan), and the backend endpoints
it comes from."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from gateway.dispatch.trace import Trace
from gateway.planning.plan import Plan


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A backend endpoint that API surfaces send their requests to, and where its answers say what they used."""

    path: str
    asks_usage: bool  # its streams carry the usage only when asked (``stream_options.include_usage``)
    usage_in: str | None = None  # the event field whose object holds the usage (None: the event's own)

    def usage(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The usage an answer or a stream's event carries (it says what the engine's cache served)."""
        usage = event.get("usage")
        if self.usage_in is not None:
            usage = usage or (event.get(self.usage_in) or {}).get("usage")
        return usage if isinstance(usage, dict) else None


CHAT = Endpoint("/v1/chat/completions", asks_usage=True)
COMPLETIONS = Endpoint("/v1/completions", asks_usage=True)
RESPONSES = Endpoint("/v1/responses", asks_usage=False, usage_in="response")  # each response.* event's response
MESSAGES = Endpoint("/v1/messages", asks_usage=False, usage_in="message")  # message_start's message


@dataclass(slots=True)
class Answer:
    trace: Trace  # the plan sent, and what happened to it
    body: dict[str, Any] | None = None
    stream: AsyncGenerator[dict[str, Any], None] | None = None

    @property
    def plan(self) -> Plan:
        return self.trace.plan

    def map(
        self,
        body: Callable[[dict[str, Any]], dict[str, Any]],
        stream: Callable[[AsyncGenerator[dict[str, Any], None]], AsyncGenerator[dict[str, Any], None]],
    ) -> Answer:
        """This answer in another shape: ``body`` for a whole one, ``stream`` for a streamed one."""
        if self.stream is not None:
            return Answer(self.trace, stream=stream(self.stream))
        assert self.body is not None  # an answer is whole or streamed
        return Answer(self.trace, body=body(self.body))

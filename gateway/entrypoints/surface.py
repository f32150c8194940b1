"""What every API surface does around its own conversion: the client's request counted as arriving until it is at
the backend, the answer shaped for the client (``answers``), and, for a conversation, the answer gathered as the
client will send it back, so that a compressed turn's warm covers the next turn's start (``echo``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from common import telemetry
from common.hosted_tools import LEFT_OUT_HEADER
from common.protocol import ChatCompletionRequest, WireModel
from gateway.dispatch.answer import Answer
from gateway.entrypoints import answers, echo
from gateway.serving import GatewayServing

Request = TypeVar("Request", bound=WireModel)


class Surface(Generic[Request]):
    rewrite: answers.Rewrite = staticmethod(answers.openai)
    operation = "chat"  # the GenAI operation it serves (its traces' gen_ai.operation.name)
    ping = False  # an Anthropic stream's ping after message_start
    gather: type[echo.Gather] | None = None  # a conversation's answers, as its client sends them back

    def __init__(self, serving: GatewayServing) -> None:
        self.serving = serving

    async def __call__(self, request: Request, headers: Mapping[str, str]) -> Answer:
        if (record := telemetry.current()) is not None:
            record.model, record.operation = getattr(request, "model", None), self.operation
        async with self.serving.arrival():
            answer = await self.answer(request, headers)
        if request.tools_left_out:
            answer.trace.notes[LEFT_OUT_HEADER] = ", ".join(request.tools_left_out)
        if self.gather is not None and self.serving.warms_next_turn(answer.plan):
            plan = answer.plan
            answer = echo.echoed(
                answer, self.gather(), lambda item: self.serving.next_turn(plan, lambda: self.next_turn(request, item))
            )
        return answers.shaped(answer, self.rewrite, self.serving.model_name, ping=self.ping)

    async def answer(self, request: Request, headers: Mapping[str, str]) -> Answer:
        """The request converted into the shared path; the backend's answer in this surface's own shape, not yet
        rewritten for the client."""
        raise NotImplementedError

    def next_turn(self, request: Request, item: Any) -> ChatCompletionRequest:
        """The chat the client's next turn renders as, up to its next message: ``request``, then the answer as the
        client echoes it (``item``), then a stand-in message (``echo.PROBE``)."""
        raise NotImplementedError

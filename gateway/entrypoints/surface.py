"""What every API surface does around its own conversion: the client's request counted as arriving until it is at
the backend, and the answer shaped for the client (``answers``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from common.protocol import WireModel
from gateway.dispatch.answer import Answer
from gateway.entrypoints import answers
from gateway.serving import GatewayServing

Request = TypeVar("Request", bound=WireModel)


class Surface(Generic[Request]):
    rewrite: answers.Rewrite = staticmethod(answers.openai)
    ping = False  # an Anthropic stream's ping after message_start

    def __init__(self, serving: GatewayServing) -> None:
        self.serving = serving

    async def __call__(self, request: Request, headers: Mapping[str, str]) -> Answer:
        async with self.serving.arrival():
            answer = await self.answer(request, headers)
        return answers.shaped(answer, self.rewrite, self.serving.model_name, ping=self.ping)

    async def answer(self, request: Request, headers: Mapping[str, str]) -> Answer:
        """The request converted into the shared path; the backend's answer in this surface's own shape, not yet
        rewritten for the client."""
        raise NotImplementedError

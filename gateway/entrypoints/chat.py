"""OpenAI's chat completions: the chat as it came, to the shared path (``GatewayServing.serve``), which plans it as
the target reads it and sends the client's body to the backend's own chat endpoint (with the swap, or the kept
messages, or the kept tokens as a completion whose answers come back as chat)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.cancellation import with_cancellation
from common.protocol import ChatCompletionRequest, ChatMessage
from gateway.dispatch.answer import CHAT, Answer
from gateway.entrypoints import echo
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.serving import Converted, GatewayServing


class ChatAPI(Surface[ChatCompletionRequest]):
    gather = echo.ChatGather

    async def answer(self, request: ChatCompletionRequest, headers: Mapping[str, str]) -> Answer:
        """The chat's answer in chat's shape, not yet rewritten for the client."""
        return await self.serving.serve(Converted(request, request, CHAT), headers)

    def next_turn(self, request: ChatCompletionRequest, item: dict[str, Any]) -> ChatCompletionRequest:
        after = [ChatMessage.model_validate(item), ChatMessage(role="user", content=echo.PROBE)]
        return request.model_copy(update={"messages": [*request.messages, *after]})


NAME = "chat"
router = APIRouter(dependencies=AUTH)


def build(serving: GatewayServing, built: dict[str, Any]) -> ChatAPI:
    return ChatAPI(serving)


@router.post("/v1/chat/completions")
@with_cancellation
async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
    """OpenAI Chat Completions, streamed or not; long prompts compressed (``x-keep-rate``, ``x-specprefill``)."""
    return await respond(NAME, raw_request, raw_request.app.state.surfaces[NAME](request, raw_request.headers))

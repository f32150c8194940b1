"""OpenAI's chat completions: the chat planned as the target reads it, then the client's body to the backend's
own endpoint with the swap, or (backends without the swap) the kept messages, or the kept tokens at their
positions as a completion whose answers come back as chat."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.cancellation import with_cancellation
from common.chat import ChatChunkConverter, as_chat_chunks, completion_to_chat
from common.protocol import ChatCompletionRequest, ChatMessage
from gateway.dispatch.answer import CHAT, COMPLETIONS, Answer
from gateway.engines.kinds import Kept
from gateway.entrypoints import echo
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.serving import GatewayServing


class ChatAPI(Surface[ChatCompletionRequest]):
    gather = echo.ChatGather

    async def answer(self, request: ChatCompletionRequest, headers: Mapping[str, str]) -> Answer:
        """The chat's answer in chat's shape, not yet rewritten for the client (other surfaces that convert
        their requests to chat, on backends without the swap, take it from here)."""
        serving, model = self.serving, self.serving.model_name
        plan, prompt = await serving.planned(request, headers)
        body = await serving.backend_body(request)
        if serving.swaps or plan.passthrough or plan.position_ids is None:
            return await serving.swapped(plan, body, CHAT)
        kept = Kept(plan.token_ids, plan.position_ids, request.completion_params(), request.messages, prompt.rendered)
        body, chat = serving.backend.kind.kept_body(body, kept, serving.tokenizer)
        if chat:
            return await serving.forward(plan, body, CHAT)
        answer = await serving.forward(plan, body, COMPLETIONS)
        return answer.map(
            lambda b: completion_to_chat(b, model), lambda s: as_chat_chunks(s, ChatChunkConverter(model))
        )

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

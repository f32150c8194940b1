"""Anthropic's Messages API: the request converted to chat as vLLM converts it (``common.messages``) and planned
like a chat (the system prompt and tool definitions kept whole, fresh / extend / whole, warming). The shared
path (``GatewayServing.serve``) sends backends that render requests themselves the client's own body at their
``/v1/messages`` with the swap; the others get the chat, and its answers come back as Messages answers and
events (``from_chat``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common import messages as anthropic
from common.cancellation import with_cancellation
from common.errors import shaped_errors
from common.messages import (
    ContentBlock,
    Conversation,
    MessageParam,
    MessagesRequest,
    chat_to_message,
    merges_inline_system,
    message_events,
)
from common.protocol import ChatCompletionRequest
from gateway.dispatch.answer import MESSAGES, Answer
from gateway.entrypoints import answers, echo
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.serving import Converted, GatewayServing


class MessagesAPI(Surface[MessagesRequest]):
    rewrite = staticmethod(answers.anthropic)
    ping = True
    gather = echo.MessageGather

    def __init__(self, serving: GatewayServing) -> None:
        super().__init__(serving)
        self.merge_inline_system = merges_inline_system(serving.tokenizer)  # as vLLM decides it for the template

    async def answer(self, request: MessagesRequest, headers: Mapping[str, str]) -> Answer:
        model = self.serving.model_name
        chat = request.as_chat(self.merge_inline_system)
        chat.specprefill = request.specprefill

        def adjust(body: dict[str, Any]) -> None:
            body["max_tokens"] = chat.max_tokens  # lowered to the room the prompt leaves, where it asked for more

        def from_chat(answer: Answer) -> Answer:
            return answer.map(lambda body: chat_to_message(body, model), lambda stream: message_events(stream, model))

        return await self.serving.serve(Converted(chat, request, MESSAGES, adjust, from_chat=from_chat), headers)

    def next_turn(self, request: MessagesRequest, item: list[dict[str, Any]]) -> ChatCompletionRequest:
        answer = MessageParam(role="assistant", content=[ContentBlock.model_validate(block) for block in item])
        after = [answer, MessageParam(role="user", content=echo.PROBE)]
        return request.model_copy(update={"messages": [*request.messages, *after]}).as_chat(self.merge_inline_system)

    def count_tokens(self, request: Conversation) -> int:
        """The prompt's tokens, with the target's tokenizer and chat template."""
        self.serving.check_model(request.model)
        return len(self.serving.prompt(request.as_chat(self.merge_inline_system)).token_ids)


NAME = "messages"
router = APIRouter(route_class=shaped_errors(anthropic.error_body), dependencies=AUTH)


def build(serving: GatewayServing, built: dict[str, Any]) -> MessagesAPI:
    return MessagesAPI(serving)


@router.post("/v1/messages")
@with_cancellation
async def messages(request: MessagesRequest, raw_request: Request) -> Response:
    """Anthropic's Messages API, streamed or not; compressed like chat; errors in Anthropic's shape."""
    work = raw_request.app.state.surfaces[NAME](request, raw_request.headers)
    return await respond(NAME, raw_request, work, named=True, error_shape=anthropic.error_body)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Conversation, raw_request: Request) -> JSONResponse:
    """Anthropic's token count of a Messages request, as the target's tokenizer renders it."""
    return JSONResponse(anthropic.count_tokens_body(raw_request.app.state.surfaces[NAME].count_tokens(request)))

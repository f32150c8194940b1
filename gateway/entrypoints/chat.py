"""OpenAI's chat completions: the chat planned as the target reads it, then the client's body to the backend's
own endpoint with the swap, or (backends without the swap) the kept messages, or the kept tokens at their
positions as a completion whose answers come back as chat."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.cancellation import with_cancellation
from common.chat import ChatChunkConverter, as_chat_chunks, completion_to_chat
from common.protocol import ChatCompletionRequest
from gateway.answer import CHAT, COMPLETIONS, Answer
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.text_kind import kept_messages


class ChatAPI(Surface):
    async def answer(self, request: ChatCompletionRequest, headers) -> Answer:
        """The chat's answer in chat's shape, not yet rewritten for the client (other surfaces that convert
        their requests to chat, on backends without the swap, take it from here)."""
        serving, model = self.serving, self.serving.model_name
        plan, prompt = await serving.planned(request, headers)
        body = await serving.backend_body(request)
        if serving.swaps or plan.passthrough or plan.kept_indices is None:
            return await serving.swapped(plan, body, CHAT)
        if not serving.backend.kind.reads_tokens:
            body["messages"] = kept_messages(serving.tokenizer, request.messages, prompt.rendered, plan.kept_indices)
            return await serving.forward(plan, body, CHAT)
        body = serving.backend.kind.token_body(
            body["model"], plan.kept_token_ids(), plan.kept_indices, request.completion_params()
        )
        answer = await serving.forward(plan, body, COMPLETIONS)
        return answer.map(
            lambda b: completion_to_chat(b, model), lambda s: as_chat_chunks(s, ChatChunkConverter(model))
        )


NAME = "chat"
router = APIRouter(dependencies=AUTH)


def build(serving, built: dict) -> ChatAPI:
    return ChatAPI(serving)


@router.post("/v1/chat/completions")
@with_cancellation
async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
    """OpenAI Chat Completions, streamed or not; long prompts compressed (``x-keep-rate``, ``x-specprefill``)."""
    return await respond(NAME, raw_request, raw_request.app.state.surfaces[NAME](request, raw_request.headers))

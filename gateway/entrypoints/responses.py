"""OpenAI's Responses API: rendered as the backend renders it (``ResponsesRequest.as_chat``), planned like a chat,
and the client's own body forwarded to the backend's ``/v1/responses`` with the swap. A request the gateway
cannot render (reasoning items, a stored previous response), or a backend kind without the swap, goes whole."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.cancellation import with_cancellation
from common.errors import InvalidRequestError
from common.protocol import ChatCompletionRequest
from common.responses import ResponsesRequest, engine_input
from gateway.dispatch.answer import RESPONSES, Answer
from gateway.entrypoints import echo
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.planning.policy import Reason
from gateway.serving import Converted, GatewayServing

logger = logging.getLogger("specprefill.gateway")


class ResponsesAPI(Surface[ResponsesRequest]):
    gather = echo.ResponseGather

    async def answer(self, request: ResponsesRequest, headers: Mapping[str, str]) -> Answer:
        try:
            chat = request.as_chat()
        except InvalidRequestError as exc:
            logger.debug("Responses request forwarded whole: %s", exc.message)
            return await self.serving.serve(Converted(None, request, RESPONSES, None, Reason.UNSCORED_CONTENT), {})
        chat.specprefill = request.specprefill

        def adjust(body: dict[str, Any]) -> None:
            body["input"] = engine_input(body.get("input"))  # as the gateway rendered it: what the engine takes

        return await self.serving.serve(Converted(chat, request, RESPONSES, adjust), headers)

    def next_turn(self, request: ResponsesRequest, item: list[dict[str, Any]]) -> ChatCompletionRequest:
        earlier = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
        after = [*item, {"type": "message", "role": "user", "content": echo.PROBE}]
        return request.model_copy(update={"input": [*earlier, *after]}).as_chat()


NAME = "responses"
router = APIRouter(dependencies=AUTH)


def build(serving: GatewayServing, built: dict[str, Any]) -> ResponsesAPI:
    return ResponsesAPI(serving)


@router.post("/v1/responses")
@with_cancellation
async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
    """OpenAI Responses (``instructions`` + ``input``), streamed or not; compressed like chat."""
    surface = raw_request.app.state.surfaces[NAME]
    return await respond(NAME, raw_request, surface(request, raw_request.headers), named=True)

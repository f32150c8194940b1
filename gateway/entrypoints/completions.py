"""OpenAI's completions: the request as it came, to the shared path (``GatewayServing.serve``), which plans the
prompt as it is tokenized and sends the client's body to the backend's own endpoint (with the swap, or the kept
text, or the kept tokens at their positions)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.cancellation import with_cancellation
from common.protocol import CompletionRequest
from gateway.dispatch.answer import COMPLETIONS, Answer
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.serving import Converted, GatewayServing


class CompletionsAPI(Surface[CompletionRequest]):
    operation = "text_completion"

    async def answer(self, request: CompletionRequest, headers: Mapping[str, str]) -> Answer:
        return await self.serving.serve(Converted(request, request, COMPLETIONS), headers)


NAME = "completions"
router = APIRouter(dependencies=AUTH)


def build(serving: GatewayServing, built: dict[str, Any]) -> CompletionsAPI:
    return CompletionsAPI(serving)


@router.post("/v1/completions")
@with_cancellation
async def completions(request: CompletionRequest, raw_request: Request) -> Response:
    """OpenAI Completions (a text or token-ID prompt), streamed or not; compressed like chat."""
    return await respond(NAME, raw_request, raw_request.app.state.surfaces[NAME](request, raw_request.headers))

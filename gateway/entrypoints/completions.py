"""OpenAI's completions: the prompt planned as it is tokenized, then the client's body to the backend's own
endpoint with the swap, or the kept text, or the kept tokens at their positions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.cancellation import with_cancellation
from common.protocol import CompletionRequest
from gateway.dispatch.answer import COMPLETIONS, Answer
from gateway.engines.kinds import Kept
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.serving import GatewayServing


class CompletionsAPI(Surface[CompletionRequest]):
    operation = "text_completion"

    async def answer(self, request: CompletionRequest, headers: Mapping[str, str]) -> Answer:
        serving = self.serving
        plan, _ = await serving.planned(request, headers)
        body = await serving.backend_body(request)
        if serving.swaps or plan.passthrough or plan.position_ids is None:
            return await serving.swapped(plan, body, COMPLETIONS)
        kept = Kept(plan.token_ids, plan.position_ids, request.completion_params())
        body, _ = serving.backend.kind.kept_body(body, kept, serving.tokenizer)
        return await serving.forward(plan, body, COMPLETIONS)


NAME = "completions"
router = APIRouter(dependencies=AUTH)


def build(serving: GatewayServing, built: dict[str, Any]) -> CompletionsAPI:
    return CompletionsAPI(serving)


@router.post("/v1/completions")
@with_cancellation
async def completions(request: CompletionRequest, raw_request: Request) -> Response:
    """OpenAI Completions (a text or token-ID prompt), streamed or not; compressed like chat."""
    return await respond(NAME, raw_request, raw_request.app.state.surfaces[NAME](request, raw_request.headers))

"""OpenAI's completions: the prompt planned as it is tokenized, then the client's body to the backend's own
endpoint with the swap, or the kept text, or the kept tokens at their positions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.cancellation import with_cancellation
from common.protocol import CompletionRequest
from gateway.answer import COMPLETIONS, Answer
from gateway.entrypoints.http import AUTH, respond
from gateway.entrypoints.surface import Surface
from gateway.text_kind import kept_text


class CompletionsAPI(Surface):
    async def answer(self, request: CompletionRequest, headers) -> Answer:
        serving = self.serving
        plan, _ = await serving.planned(request, headers)
        body = await serving.backend_body(request)
        if serving.swaps or plan.passthrough or plan.kept_indices is None:
            return await serving.swapped(plan, body, COMPLETIONS)
        if not serving.backend.kind.reads_tokens:
            body = {
                "model": body["model"],
                "prompt": kept_text(serving.tokenizer, plan.token_ids, plan.kept_indices),
                **request.completion_params(),
            }
        else:
            body = serving.backend.kind.token_body(
                body["model"],
                plan.kept_token_ids(),
                plan.kept_indices,
                request.completion_params(),
            )
        return await serving.forward(plan, body, COMPLETIONS)


NAME = "completions"
router = APIRouter(dependencies=AUTH)


def build(serving, built: dict) -> CompletionsAPI:
    return CompletionsAPI(serving)


@router.post("/v1/completions")
@with_cancellation
async def completions(request: CompletionRequest, raw_request: Request) -> Response:
    """OpenAI Completions (a text or token-ID prompt), streamed or not; compressed like chat."""
    return await respond(NAME, raw_request, raw_request.app.state.surfaces[NAME](request, raw_request.headers))

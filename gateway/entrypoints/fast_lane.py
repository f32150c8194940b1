"""OpenAI's chat completions and completions without FastAPI's layers in front of them.

Every request pays those layers before its handler runs: five middlewares, the router's matching, the dependency
solver, the body read and parsed, each layer again on every event it sends (``lab/benchmarks/gateway_timeline.py``:
0.55 ms before the handler of a whole streamed chat on 2 AMD EPYC cores). A POST to either endpoint whose body is
JSON that the endpoint's request model accepts, from a client that sends the key, runs the route's own handler
here (``chat.chat_completions``, ``completions.completions``: the same work, cancellation and answer). Anything
else (another path or method, a body that is not JSON or that the model refuses, a missing key, a content type
that is not JSON) goes through FastAPI with the body as it was read, so every error is the one FastAPI's route
gives."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.types import Message, Receive, Scope, Send

from common.errors import error_response, to_api_error
from common.protocol import ChatCompletionRequest, CompletionRequest, WireModel
from common.request_body import request_body
from gateway.entrypoints import chat, completions
from gateway.entrypoints.http import key_accepted

Handler = Callable[..., Awaitable[Any]]
ROUTES: dict[str, tuple[type[WireModel], Handler]] = {
    "/v1/chat/completions": (ChatCompletionRequest, chat.chat_completions),
    "/v1/completions": (CompletionRequest, completions.completions),
}


def takes(scope: Scope) -> bool:
    """Whether the lane may take this request (the body not yet read)."""
    return scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in ROUTES


async def serve(app: FastAPI, scope: Scope, receive: Receive, send: Send, whole: Handler) -> None:
    """The request served by its route's handler, or by ``whole`` (FastAPI's path) with its body replayed."""
    model, handler = ROUTES[scope["path"]]
    body = await request_body(receive)
    if body is None:  # the client left before its body was in: no one to answer
        return
    scope["app"] = app
    raw_request = Request(scope, receive)
    request = _parsed(model, body, raw_request)
    if request is None:
        await whole(scope, _replayed(body, receive), send)
        return
    try:
        response = await handler(request=request, raw_request=raw_request)
    except Exception as exc:  # the route's errors, as FastAPI's handlers answer them (an unexpected one logged)
        response = error_response(to_api_error(exc))
    await response(scope, receive, send)


def _parsed(model: type[WireModel], body: bytes, raw_request: Request) -> WireModel | None:
    """The request, where the lane can answer it as FastAPI's route would; else None."""
    content_type = raw_request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json" or not key_accepted(raw_request):
        return None
    try:
        return model.model_validate(orjson.loads(body))
    except (orjson.JSONDecodeError, ValidationError, RecursionError):
        return None


def _replayed(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body it gave already given again first."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

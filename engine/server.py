"""The reference engine behind its own HTTP server (``specprefill engine --model PATH``)."""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common import messages as anthropic
from common.cancellation import with_cancellation
from common.errors import APIError, install_error_handlers, shaped_errors
from common.protocol import ChatCompletionRequest, WireModel
from common.responses import ResponsesRequest
from common.streams import EventStreamResponse, sse_body
from engine.metrics import EngineMetrics
from engine.protocol import EngineCompletionRequest
from engine.serving import EngineServing
from engine.settings import EngineSettings


def create_app(settings: EngineSettings | None = None, *, serving: EngineServing | None = None) -> FastAPI:
    """The engine app, loading the model from ``settings`` at start-up; or around ``serving`` (tests)."""
    assert (settings is None) != (serving is None), "give settings or serving"
    app = FastAPI(title="SpecPrefill reference engine", lifespan=functools.partial(_lifespan, settings, serving))
    app.state.metrics = EngineMetrics()
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(messages_router)
    app.include_router(service_router)
    return app


@asynccontextmanager
async def _lifespan(
    settings: EngineSettings | None, serving: EngineServing | None, app: FastAPI
) -> AsyncIterator[None]:
    metrics: EngineMetrics = app.state.metrics
    if serving is None:
        assert settings is not None  # create_app takes one or the other
        serving = EngineServing.from_settings(settings, on_active_change=metrics.active.set)
        started = True
    else:
        started = False
    app.state.serving = serving
    engine = app.state.serving.engine
    engine.scheduler.on_active_change = metrics.active.set
    engine.on_queued = metrics.queue_time.observe
    engine.on_yielded = metrics.yields.inc
    block_size, capacity = engine.cache_shape()
    metrics.cache_info.labels(str(block_size), str(capacity)).set(1)
    try:
        yield
    finally:
        if started:  # the engine this app started
            app.state.serving.close()


R = TypeVar("R", bound=WireModel)
router = APIRouter()
messages_router = APIRouter(route_class=shaped_errors(anthropic.error_body))
service_router = APIRouter()


async def _answer(
    raw_request: Request,
    request: R,
    whole: Callable[[R], Awaitable[dict[str, Any]]],
    streamed: Callable[[R], Awaitable[AsyncGenerator[dict[str, Any], None]]],
    named: bool = False,
    error_shape: Callable[[APIError], dict[str, Any]] | None = None,
) -> Response:
    """``whole(request)``'s answer, or ``streamed(request)``'s events where the request asks for a stream; each
    counted once it has ended (``ok`` or ``error``)."""
    metrics: EngineMetrics = raw_request.app.state.metrics
    if not getattr(request, "stream", False):
        body = await whole(request)
        metrics.requests.labels("ok").inc()
        return JSONResponse(body)
    events = sse_body(
        await streamed(request),
        on_error=lambda _: metrics.requests.labels("error").inc(),
        on_done=lambda: metrics.requests.labels("ok").inc(),
        named=named,
        error_shape=error_shape,
    )
    return EventStreamResponse(events)


@router.post("/v1/completions")
@with_cancellation
async def completions(request: EngineCompletionRequest, raw_request: Request) -> Response:
    serving: EngineServing = raw_request.app.state.serving
    return await _answer(raw_request, request, serving.completion, serving.completion_stream)


@router.post("/v1/chat/completions")
@with_cancellation
async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
    """Chat through the model's chat template, so the engine stands in for any OpenAI-compatible server."""
    serving: EngineServing = raw_request.app.state.serving
    return await _answer(raw_request, request, serving.chat_completion, serving.chat_completion_stream)


@router.post("/v1/responses")
@with_cancellation
async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
    """OpenAI's Responses API through the chat template; takes the swap as chat does."""
    serving: EngineServing = raw_request.app.state.serving
    return await _answer(raw_request, request, serving.responses, serving.responses_stream, named=True)


@messages_router.post("/v1/messages")
@with_cancellation
async def messages(request: anthropic.MessagesRequest, raw_request: Request) -> Response:
    """Anthropic's Messages API through the chat template, converted as vLLM converts it; takes the swap."""
    serving: EngineServing = raw_request.app.state.serving
    return await _answer(
        raw_request, request, serving.messages, serving.messages_stream, named=True, error_shape=anthropic.error_body
    )


@messages_router.post("/v1/messages/count_tokens")
async def count_tokens(request: anthropic.Conversation, raw_request: Request) -> JSONResponse:
    return JSONResponse(anthropic.count_tokens_body(raw_request.app.state.serving.count_tokens(request)))


@service_router.get("/v1/models")
async def models(raw_request: Request) -> JSONResponse:
    return JSONResponse(raw_request.app.state.serving.models())


@service_router.get("/health")
async def health(raw_request: Request) -> JSONResponse:
    engine = raw_request.app.state.serving.engine
    return JSONResponse({"status": "ok", "active_requests": engine.active})


@service_router.get("/kv_event_sources")
async def kv_event_sources(raw_request: Request) -> JSONResponse:
    """Where the KV cache events go, as vLLM's endpoint of that name says it (one data-parallel rank)."""
    events = raw_request.app.state.serving.events
    return JSONResponse({} if events is None else {"0": events.source()})


@service_router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw_request: Request) -> Response:
    """Drops the prefix cache, as vLLM's endpoint of that name (its KV events say so: AllBlocksCleared)."""
    cache = raw_request.app.state.serving.engine.prefix_cache
    if cache is not None:
        cache.clear()
    return Response(status_code=200)


@service_router.get("/metrics")
async def prometheus(raw_request: Request) -> Response:
    return Response(generate_latest(raw_request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

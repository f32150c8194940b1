"""The reference engine behind its own HTTP server (``specprefill engine --model PATH``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.engine import ReferenceEngine
from engine.protocol import CompletionRequest
from engine.serving import EngineServing
from specprefill.chat_format import ChatCompletionRequest
from specprefill.openai_api import SSE_DONE, install_error_handlers, sse, sse_error, with_cancellation


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.active = Gauge("specprefill_engine_active_requests", "Requests waiting or running",
                            registry=self.registry)
        self.requests = Counter("specprefill_engine_requests", "Completion requests by outcome", ["status"],
                                registry=self.registry)


def build_serving(model_path: str, *, device: str | None = None, dtype: str = "auto", served_name: str | None = None,
                  max_running: int = 8, max_waiting: int = 64, prefill_chunk: int = 2048,
                  on_active_change=None) -> EngineServing:
    from draft_worker.loader import load_causal_lm, load_tokenizer

    model = load_causal_lm(model_path, device=device, dtype=dtype)
    engine = ReferenceEngine(model, load_tokenizer(model_path), max_running=max_running, max_waiting=max_waiting,
                             prefill_chunk=prefill_chunk, on_active_change=on_active_change)
    names = [n for n in (served_name, str(model_path)) if n]
    return EngineServing(engine, names)


def create_app(model_path: str | None = None, *, serving: EngineServing | None = None, **engine_options) -> FastAPI:
    """The engine app. Pass ``serving`` to reuse a loaded engine (tests), else ``model_path``."""
    metrics = EngineMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = serving is None
        app.state.serving = serving or build_serving(
            model_path, on_active_change=metrics.active.set, **engine_options
        )
        if not owned:
            app.state.serving.engine._on_active_change = metrics.active.set
        try:
            yield
        finally:
            if owned:
                app.state.serving.engine.close()

    app = FastAPI(title="SpecPrefill reference engine", lifespan=lifespan)
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.post("/v1/completions")
    @with_cancellation
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        serving_: EngineServing = raw_request.app.state.serving
        if request.stream:
            chunks = await serving_.completion_stream(request)
            return StreamingResponse(_sse_stream(chunks, metrics), media_type="text/event-stream")
        body = await serving_.completion(request)
        metrics.requests.labels("ok").inc()
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    @with_cancellation
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Chat through the model's chat template, so the engine stands in for any OpenAI-compatible server."""
        serving_: EngineServing = raw_request.app.state.serving
        if request.stream:
            chunks = await serving_.chat_completion_stream(request)
            return StreamingResponse(_sse_stream(chunks, metrics), media_type="text/event-stream")
        body = await serving_.chat_completion(request)
        metrics.requests.labels("ok").inc()
        return JSONResponse(body)

    @app.get("/v1/models")
    async def models(raw_request: Request) -> JSONResponse:
        return JSONResponse(raw_request.app.state.serving.models())

    @app.get("/health")
    async def health(raw_request: Request) -> JSONResponse:
        engine = raw_request.app.state.serving.engine
        return JSONResponse({"status": "ok", "active_requests": engine.active})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _sse_stream(chunks: AsyncIterator[dict], metrics: EngineMetrics) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield sse(chunk)
        metrics.requests.labels("ok").inc()
    except Exception as exc:  # the stream has begun: one error event, then [DONE]
        metrics.requests.labels("error").inc()
        yield sse_error(exc)
    yield SSE_DONE

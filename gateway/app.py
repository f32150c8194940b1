"""The gateway app: thin routers over ``GatewayServing``; models load in the lifespan."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.backends import Backend, HTTPBackend, InProcessBackend
from gateway.cache import MemoryScoreCache, RedisScoreCache, ScoreCache
from gateway.draft import DraftClient, LocalDraft, RemoteDraft
from gateway.scores import ScoreProvider
from gateway.metrics import GatewayMetrics
from gateway.serving import Answer, GatewayServing
from gateway.settings import GatewaySettings
from specprefill.chat_format import ChatCompletionRequest, CompletionRequest
from specprefill.openai_api import (
    SSE_DONE,
    APIError,
    AuthenticationError,
    install_error_handlers,
    sse,
    sse_error,
    with_cancellation,
)

logger = logging.getLogger("specprefill.gateway")
DEMO_NAME = "specprefill-demo"


def create_app(settings: GatewaySettings | None = None, *, draft: DraftClient | None = None,
               backend: Backend | None = None) -> FastAPI:
    """Builds the gateway. ``draft`` and ``backend`` replace the configured ones (embedding, tests)."""
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.serving = await _build_serving(settings, metrics, draft, backend)
        logger.info("gateway ready: model %r, backend %s", app.state.serving.model_name,
                    settings.backend_url or "reference engine in-process")
        try:
            yield
        finally:
            await app.state.serving.backend.close()
            await app.state.serving.draft.close()
            if app.state.serving.scores.cache is not None:
                await app.state.serving.scores.cache.close()

    app = FastAPI(title="SpecPrefill gateway", lifespan=lifespan)
    install_error_handlers(app)
    auth = [Depends(_api_key_checker(settings))]

    @app.post("/v1/chat/completions", dependencies=auth)
    @with_cancellation
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await _respond("chat", raw_request, lambda s: s.chat(request, raw_request.headers))

    @app.post("/v1/completions", dependencies=auth)
    @with_cancellation
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await _respond("completions", raw_request, lambda s: s.completion(request, raw_request.headers))

    @app.post("/v1/specprefill/compress", dependencies=auth)
    async def compress(body: dict, raw_request: Request) -> JSONResponse:
        return JSONResponse(await raw_request.app.state.serving.compress(body, raw_request.headers))

    @app.get("/v1/models", dependencies=auth)
    async def models(raw_request: Request) -> JSONResponse:
        serving: GatewayServing = raw_request.app.state.serving
        data = [{"id": serving.model_name, "object": "model", "created": int(time.time()), "owned_by": "specprefill"}]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health(raw_request: Request) -> JSONResponse:
        serving: GatewayServing = raw_request.app.state.serving
        draft_ready, backend_ready = await serving.draft.ready(), await serving.backend.ready()
        return JSONResponse({
            "status": "ok" if draft_ready and backend_ready else "degraded",
            "draft": {"ready": draft_ready},
            "backend": {"ready": backend_ready, "kind": serving.backend.kind},
        })

    @app.get("/metrics", dependencies=[] if settings.metrics_public else auth)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _respond(endpoint: str, raw_request: Request, work: Callable) -> Response:
    serving: GatewayServing = raw_request.app.state.serving
    metrics = serving.metrics
    start = time.perf_counter()
    try:
        answer: Answer = await work(serving)
    except APIError as exc:
        metrics.errors.labels(endpoint, str(exc.status_code)).inc()
        raise
    plan = answer.plan
    metrics.requests.labels(endpoint, plan.status, plan.reason or "").inc()
    metrics.kept_tokens.observe(plan.kept_tokens)

    def first_byte() -> None:
        metrics.ttft.labels(endpoint, plan.status).observe(time.perf_counter() - start)

    if answer.stream is not None:
        return StreamingResponse(_sse(answer.stream, first_byte, metrics, endpoint),
                                 media_type="text/event-stream", headers=plan.headers())
    first_byte()
    return JSONResponse(answer.body, headers=plan.headers())


async def _sse(stream: AsyncIterator[dict], first_byte: Callable[[], None], metrics: GatewayMetrics,
               endpoint: str) -> AsyncIterator[bytes]:
    first = True
    try:
        async for chunk in stream:
            if first:
                first_byte()
                first = False
            yield sse(chunk)
    except Exception as exc:  # the stream has begun: one error event, then [DONE]
        logger.warning("stream failed after it began: %s", exc)
        metrics.errors.labels(endpoint, str(getattr(exc, "status_code", 500))).inc()
        yield sse_error(exc)
    finally:
        await stream.aclose()
    yield SSE_DONE


def _api_key_checker(settings: GatewaySettings):
    expected = settings.api_key.get_secret_value().encode() if settings.api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise AuthenticationError("a valid API key is required: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")

    return check


async def _build_serving(settings: GatewaySettings, metrics: GatewayMetrics, draft: DraftClient | None,
                         backend: Backend | None) -> GatewayServing:
    from draft_worker import DraftWorker
    from draft_worker.loader import check_same_tokenizer, load_tokenizer
    from specprefill.demo_models import ensure_demo_models

    target_path, draft_path, demo = settings.target_model, settings.draft_model, False
    if target_path is None and draft_path is None:
        root = ensure_demo_models()
        target_path, draft_path, demo = str(root / "target"), str(root / "draft"), True
    elif target_path is None or (draft_path is None and not settings.draft_worker_url and draft is None):
        raise ValueError("set both --target-model and --draft-model (or neither, for the demo pair)")
    tokenizer = load_tokenizer(target_path)
    if draft is None and settings.draft_worker_url:
        draft = RemoteDraft(settings.draft_worker_url, settings.scoring_config(), timeout=settings.draft_timeout)
        await _check_remote_tokenizer(draft, tokenizer)
    elif draft is None:
        worker = DraftWorker.from_pretrained(draft_path, settings.scoring_config(), device=settings.device,
                                             dtype=settings.dtype,
                                             prefix_cache_bytes=settings.draft_prefix_cache_mb << 20)
        check_same_tokenizer(worker.tokenizer, tokenizer)
        draft = LocalDraft(worker)
    served = settings.served_model_name or (DEMO_NAME if demo else target_path)
    if backend is None:
        if settings.embedded:
            from engine.server import build_serving

            backend = InProcessBackend(build_serving(target_path, device=settings.device, dtype=settings.dtype,
                                                     served_name=served))
        else:
            api_key = settings.backend_api_key.get_secret_value() if settings.backend_api_key else None
            backend = HTTPBackend(settings.backend_url, settings.backend_kind, model=settings.backend_model,
                                  api_key=api_key, connect_timeout=settings.backend_connect_timeout,
                                  read_timeout=settings.backend_read_timeout)
    names = list(dict.fromkeys(n for n in (served, target_path, settings.backend_model) if n))
    scores = ScoreProvider(draft, _score_cache(settings), metrics, settings.redis_key_prefix)
    return GatewayServing(settings, tokenizer, draft, backend, metrics, names, scores)


def _score_cache(settings: GatewaySettings) -> ScoreCache | None:
    max_entry = settings.score_cache_max_entry_kb << 10
    if settings.redis_url:
        return RedisScoreCache(settings.redis_url, settings.score_cache_ttl, max_entry)
    if settings.memory_cache_mb > 0:
        return MemoryScoreCache(settings.memory_cache_mb << 20, settings.score_cache_ttl, max_entry)
    return None


async def _check_remote_tokenizer(draft: RemoteDraft, tokenizer) -> None:
    """Refuses to start when a draft worker that answers has another tokenizer than the target."""
    from draft_worker.loader import TokenizerMismatchError
    from draft_worker.service import tokenizer_fingerprint

    expected = tokenizer_fingerprint(tokenizer)
    for url, info in (await draft.infos()).items():
        if info.get("tokenizer_fingerprint") not in (None, expected):
            raise TokenizerMismatchError(
                f"the draft worker at {url} uses another tokenizer than the target: SpecPrefill needs a draft "
                "from the target's model family (same tokenizer)")

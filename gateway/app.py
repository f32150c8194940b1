"""The gateway app: thin routers over one serving object per API surface (``gateway.entrypoints``), which share
``GatewayServing``; models load in the lifespan."""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common import messages as anthropic
from common.cancellation import with_cancellation
from common.errors import APIError, AuthenticationError, install_error_handlers, shaped_errors
from common.protocol import ChatCompletionRequest, CompletionRequest
from common.responses import ResponsesRequest
from common.streams import sse_body
from gateway.backends import Backend
from gateway.draft import DraftClient
from gateway.entrypoints.chat import ChatAPI
from gateway.entrypoints.completions import CompletionsAPI
from gateway.entrypoints.dry_run import DryRunAPI
from gateway.entrypoints.messages import MessagesAPI
from gateway.entrypoints.responses import ResponsesAPI
from gateway.inspector import page
from gateway.metrics import GatewayMetrics
from gateway.serving import Answer, GatewayServing
from gateway.settings import GatewaySettings
from gateway.wiring import build_serving

logger = logging.getLogger("specprefill.gateway")


def create_app(
    settings: GatewaySettings | None = None, *, draft: DraftClient | None = None, backend: Backend | None = None
) -> FastAPI:
    """Builds the gateway. ``draft`` and ``backend`` replace the configured ones (embedding, tests)."""
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving = app.state.serving = await build_serving(settings, metrics, draft, backend)
        chat = app.state.chat = ChatAPI(serving)  # one serving object per API surface, over the shared path
        app.state.completions = CompletionsAPI(serving)
        app.state.responses = ResponsesAPI(serving)
        app.state.messages = MessagesAPI(serving, chat)
        app.state.dry_run = DryRunAPI(serving)
        logger.info(
            "gateway ready: model %r, backend %s",
            serving.model_name,
            ", ".join(settings.backend_url) or "reference engine in-process",
        )
        try:
            yield
        finally:
            await serving.close()

    app = FastAPI(title="SpecPrefill gateway", lifespan=lifespan)
    install_error_handlers(app)
    auth = [Depends(_api_key_checker(settings))]

    @app.post("/v1/chat/completions", dependencies=auth)
    @with_cancellation
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        """OpenAI Chat Completions, streamed or not; long prompts compressed (``x-keep-rate``, ``x-specprefill``)."""
        return await _respond("chat", raw_request, raw_request.app.state.chat(request, raw_request.headers))

    @app.post("/v1/completions", dependencies=auth)
    @with_cancellation
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        """OpenAI Completions (a text or token-ID prompt), streamed or not; compressed like chat."""
        return await _respond(
            "completions", raw_request, raw_request.app.state.completions(request, raw_request.headers)
        )

    @app.post("/v1/responses", dependencies=auth)
    @with_cancellation
    async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
        """OpenAI Responses (``instructions`` + ``input``), streamed or not; compressed like chat."""
        return await _respond(
            "responses", raw_request, raw_request.app.state.responses(request, raw_request.headers), named=True
        )

    messages_api = APIRouter(route_class=shaped_errors(anthropic.error_body), dependencies=auth)

    @messages_api.post("/v1/messages")
    @with_cancellation
    async def messages(request: anthropic.MessagesRequest, raw_request: Request) -> Response:
        """Anthropic's Messages API, streamed or not; compressed like chat; errors in Anthropic's shape."""
        return await _respond(
            "messages",
            raw_request,
            raw_request.app.state.messages(request, raw_request.headers),
            named=True,
            error_shape=anthropic.error_body,
        )

    @messages_api.post("/v1/messages/count_tokens")
    async def count_tokens(request: anthropic.Conversation, raw_request: Request) -> JSONResponse:
        """Anthropic's token count of a Messages request, as the target's tokenizer renders it."""
        return JSONResponse(anthropic.count_tokens_body(raw_request.app.state.messages.count_tokens(request)))

    app.include_router(messages_api)

    @app.post("/v1/specprefill/compress", dependencies=auth)
    async def compress(body: dict, raw_request: Request, return_scores: bool = False) -> JSONResponse:
        """A dry run: what a chat or completion body would send to the backend (kept token IDs and their
        positions; ``return_scores``: every token's score too), without calling it."""
        return JSONResponse(await raw_request.app.state.dry_run.compress(body, raw_request.headers, return_scores))

    @app.post("/v1/specprefill/inspect", dependencies=auth)
    async def inspect_data(body: dict, raw_request: Request) -> JSONResponse:
        """The inspector's data for a prompt: tokens, scores, and the kept tokens at each keep rate."""
        return JSONResponse(await raw_request.app.state.dry_run.inspect(body, raw_request.headers))

    @app.get("/specprefill/inspect", dependencies=[Depends(_api_key_checker(settings, browser=True))])
    async def inspect_page() -> HTMLResponse:
        """The inspector: a page showing which tokens the target reads (``?prompt=TEXT&keep_rate=F``)."""
        return HTMLResponse(page(), headers={"cache-control": "no-store"})

    @app.get("/v1/models", dependencies=auth)
    async def models(raw_request: Request) -> JSONResponse:
        """The served model (``--served-model-name``), then its ``--model-alias`` names."""
        serving: GatewayServing = raw_request.app.state.serving
        names = [serving.model_name, *(a for a in serving.settings.model_alias if a != serving.model_name)]
        created = int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "specprefill"} for name in names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health(raw_request: Request) -> JSONResponse:
        """``ok``, or ``degraded`` while the draft or a backend replica is not ready (503 while draining);
        needs no key."""
        serving: GatewayServing = raw_request.app.state.serving
        draft_ready = await serving.draft.ready()
        ready = await asyncio.gather(*(r.backend.ready() for r in serving.replicas))
        backend = {"ready": any(ready), "kind": serving.backend.kind.name}
        if len(ready) > 1:  # replicas: the gateway serves while one of them does
            backend["replicas"] = [
                {"replica": r.index, "ready": ok, "routed": r.up} for r, ok in zip(serving.replicas, ready)
            ]
        return JSONResponse(
            {
                "status": "ok" if draft_ready and all(ready) else "degraded",
                "draft": {"ready": draft_ready, "tokenizer": getattr(serving.draft, "kind", "shared")},
                "backend": backend,
            }
        )

    @app.get("/metrics", dependencies=[] if settings.metrics_public else auth)
    async def prometheus() -> Response:
        """Prometheus metrics (the key unless ``--metrics-public``)."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _respond(
    endpoint: str,
    raw_request: Request,
    work: Awaitable[Answer],
    *,
    named: bool = False,
    error_shape: Callable[[APIError], dict] | None = None,
) -> Response:
    """``named``: a stream of named events without ``[DONE]`` (Responses, Messages); ``error_shape``: its error
    event in that API's shape."""
    metrics: GatewayMetrics = raw_request.app.state.serving.metrics
    start = time.perf_counter()
    try:
        answer = await work
    except APIError as exc:
        metrics.errors.labels(endpoint, str(exc.status_code)).inc()
        raise
    plan = answer.plan
    metrics.requests.labels(endpoint, plan.status, plan.reason or "").inc()
    metrics.kept_tokens.observe(plan.kept_tokens)

    def first_byte() -> None:
        metrics.ttft.labels(endpoint, plan.status).observe(time.perf_counter() - start)

    def failed(exc: BaseException) -> None:
        logger.warning("stream failed after it began: %s", exc)
        metrics.errors.labels(endpoint, str(getattr(exc, "status_code", 500))).inc()

    if answer.stream is not None:
        return StreamingResponse(
            sse_body(answer.stream, on_first=first_byte, on_error=failed, named=named, error_shape=error_shape),
            media_type="text/event-stream",
            headers=plan.headers(),
        )
    first_byte()
    return JSONResponse(answer.body, headers=plan.headers())


def _api_key_checker(settings: GatewaySettings, *, browser: bool = False):
    """The API key as a bearer token, as ``x-api-key`` (Anthropic's SDKs), or as the password of HTTP Basic
    credentials (any user name): a browser asks for those on the inspector page and sends them again with the
    page's own requests."""
    expected = settings.api_key.get_secret_value().encode() if settings.api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        scheme, token = scheme.lower(), token.strip()
        if "x-api-key" in request.headers:  # Anthropic's clients send the key so
            scheme, token = "bearer", request.headers["x-api-key"].strip()
        if scheme == "basic":
            try:
                token = base64.b64decode(token, validate=True).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                token = ""
        if scheme not in ("bearer", "basic") or not hmac.compare_digest(token.encode(), expected):
            raise AuthenticationError(
                "a valid API key is required: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
                + (" (in a browser: any user name, the key as password)" if browser else ""),
                code="invalid_api_key",
                headers={"www-authenticate": 'Basic realm="specprefill", charset="UTF-8"'} if browser else None,
            )

    return check

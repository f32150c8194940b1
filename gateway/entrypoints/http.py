"""What every route of the gateway shares: the API key check and the answer as an HTTP response (streamed as
server-sent events, counted in the metrics). The settings and metrics are the app's (``app.state``)."""

from __future__ import annotations

import base64
import hmac
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import Response

from common.errors import APIError, AuthenticationError
from common.json_wire import WireJSONResponse
from common.streams import EventStreamResponse, sse_body
from common.telemetry import note_usage
from gateway.dispatch.answer import Answer
from gateway.metrics import GatewayMetrics

logger = logging.getLogger("specprefill.gateway")


async def respond(
    endpoint: str,
    raw_request: Request,
    work: Awaitable[Answer],
    *,
    named: bool = False,
    error_shape: Callable[[APIError], dict[str, Any]] | None = None,
) -> Response:
    """``named``: a stream of named events without ``[DONE]`` (Responses, Messages); ``error_shape``: its error
    event in that API's shape."""
    metrics: GatewayMetrics = raw_request.app.state.metrics
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
        events = _usage_noted(answer.stream)
        return EventStreamResponse(
            sse_body(events, on_first=first_byte, on_error=failed, named=named, error_shape=error_shape),
            headers=answer.trace.headers(),
        )
    first_byte()
    note_usage((answer.body or {}).get("usage"))
    return WireJSONResponse(answer.body, headers=answer.trace.headers())


async def _usage_noted(events: AsyncGenerator[dict[str, Any], None]) -> AsyncGenerator[dict[str, Any], None]:
    """The stream as it is, its usage noted for the request's log line and span where an event carries it (chat
    and completions: the last; Responses: ``response.completed``; Messages: ``message_start`` and
    ``message_delta``)."""
    async for event in events:
        usage = event.get("usage") or (event.get("response") or event.get("message") or {}).get("usage")
        if usage:
            note_usage(usage)
        yield event


def _expected(request: Request) -> bytes | None:
    key = request.app.state.settings.api_key
    return key.get_secret_value().encode() if key else None


async def require_key(request: Request) -> None:
    """The API key as a bearer token, or as ``x-api-key`` (Anthropic's SDKs)."""
    _check(request, _expected(request), browser=False)


async def require_key_in_browser(request: Request) -> None:
    """The key as above, or as the password of HTTP Basic credentials (any user name): a browser asks for those
    on the inspector page and sends them again with the page's own requests."""
    _check(request, _expected(request), browser=True)


async def require_key_for_metrics(request: Request) -> None:
    """The key, unless ``--metrics-public``."""
    if not request.app.state.settings.metrics_public:
        _check(request, _expected(request), browser=False)


AUTH = [Depends(require_key)]


def key_accepted(request: Request) -> bool:
    """Whether ``require_key`` lets this request through."""
    try:
        _check(request, _expected(request), browser=False)
    except AuthenticationError:
        return False
    return True


def _check(request: Request, expected: bytes | None, *, browser: bool) -> None:
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

"""What the engine and the gateway share on the wire: OpenAI's error shape, SSE frames, disconnect handling."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("specprefill")


class APIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's error shape."""

    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status_code: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        if status_code is not None:
            self.status_code = status_code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


class InvalidRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "not_found_error"


class OverloadedError(APIError):
    status_code = 503
    error_type = "overloaded_error"


class UpstreamError(APIError):
    """The backend failed: 502 unreachable or broken, 504 timed out."""

    status_code = 502
    error_type = "upstream_error"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: Exception) -> bytes:
    """The frame sent when a stream has already begun: one error event (then the caller sends [DONE])."""
    if not isinstance(exc, APIError):
        exc = APIError("internal error while streaming")
    return sse(exc.body())


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    message = first.get("msg", "invalid value")
    return (f"{param}: {message}" if param else message), param


def install_error_handlers(app: FastAPI) -> None:
    """Every non-2xx answer in OpenAI's shape, whatever raised it."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(InvalidRequestError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {401: AuthenticationError, 404: NotFoundError}
        cls = kinds.get(exc.status_code, InvalidRequestError if exc.status_code < 500 else APIError)
        return error_response(cls(str(exc.detail), status_code=exc.status_code))

    @app.exception_handler(RecursionError)
    async def _too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        return error_response(InvalidRequestError("the request body is nested too deeply"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError("internal server error"))


def parse_body(model: type[BaseModel], body: dict):
    """Validates a body that did not come through FastAPI (in-process calls), with the same 400 as a router's."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise InvalidRequestError(f"{param}: {first.get('msg')}" if param else str(exc), param=param) from None


class WireModel(BaseModel):
    """Base of the request models: unknown fields are tolerated (and logged), as OpenAI clients send many."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        if self.model_extra:
            logger.debug("ignoring unknown fields in %s: %s", type(self).__name__, sorted(self.model_extra))
        return self


def with_cancellation(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Cancels a non-streaming handler when its client disconnects.

    Starlette does not notice a disconnect until it writes the response, so a long generation would run
    to the end for nobody. This runs the handler as a task beside a watcher that reads the ASGI receive
    channel; ``http.disconnect`` cancels the handler, whose ``finally`` blocks release the work (the
    engine drops the sequence, the gateway closes its backend request). The request body must already
    have been read (FastAPI does so before calling the handler), so the watcher only sees the disconnect.
    Streaming responses need no help: Starlette cancels their iterator on disconnect.
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        request: Request = kwargs["raw_request"]
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))

        async def watch() -> None:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            done, _ = await asyncio.wait({handler_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            handler_task.cancel()
            watcher.cancel()
            raise
        if handler_task in done:
            watcher.cancel()
            return handler_task.result()
        handler_task.cancel()
        return Response(status_code=499)

    return wrapper

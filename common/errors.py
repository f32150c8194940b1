"""OpenAI's error shape: typed errors, and the one mapper that renders every non-2xx answer."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

Model = TypeVar("Model", bound=BaseModel)
logger = logging.getLogger("specprefill")


class APIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's error shape."""

    status_code = 500
    error_type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
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


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as the ``APIError`` a client sees (unexpected ones say nothing about our internals)."""
    return exc if isinstance(exc, APIError) else APIError("internal server error")


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|tuple|[\w-]+\[.*\])$")


def client_field(loc: tuple[Any, ...]) -> str:
    """A validation error's location as the client's field (``messages[0].content``): the body's own keys and
    indexes, without the names pydantic gives the members of a union (``str``, ``list[...]``,
    ``function-after[...]``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and not _TYPE_TAG.match(str(part)):
            out += f".{part}" if out else str(part)
    return out


def _validation_error(errors: list[dict[str, Any]]) -> InvalidRequestError:
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return InvalidRequestError("the request body is not valid JSON")
    param = client_field(first.get("loc", ())) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)


def to_api_error(exc: BaseException) -> APIError:
    """Whatever a route raised, as the ``APIError`` its client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return _validation_error(list(exc.errors()))
    if isinstance(exc, StarletteHTTPException):
        kinds = {401: AuthenticationError, 404: NotFoundError}
        cls = kinds.get(exc.status_code, InvalidRequestError if exc.status_code < 500 else APIError)
        return cls(str(exc.detail), status_code=exc.status_code)
    if isinstance(exc, RecursionError):
        return InvalidRequestError("the request body is nested too deeply")
    logger.error("unhandled error", exc_info=exc)
    return as_api_error(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Every non-2xx answer in OpenAI's shape, whatever raised it (routes of ``shaped_errors`` in their own)."""

    async def handler(_: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc))

    for kind in (APIError, RequestValidationError, StarletteHTTPException, RecursionError, Exception):
        app.add_exception_handler(kind, handler)


def shaped_errors(shape: Callable[[APIError], dict[str, Any]]) -> type[APIRoute]:
    """A route class whose errors, whatever raised them (validation, a dependency, the work), take ``shape``
    rather than OpenAI's: another API's error shape (Anthropic's) on that API's routes."""

    class ShapedRoute(APIRoute):
        def get_route_handler(self) -> Callable[..., Any]:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:
                    error = to_api_error(exc)
                    return JSONResponse(shape(error), status_code=error.status_code, headers=error.headers)

            return route

    return ShapedRoute


def parse_body(model: type[Model], body: dict[str, Any]) -> Model:
    """Validates a body that did not come through FastAPI (in-process calls), with the same 400 as a router's."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error([dict(e) for e in exc.errors()]) from None

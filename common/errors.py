"""OpenAI's error shape: typed errors, and the one mapper that renders every non-2xx answer."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
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


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as the ``APIError`` a client sees (unexpected ones say nothing about our internals)."""
    return exc if isinstance(exc, APIError) else APIError("internal server error")


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def _validation_error(errors: list[dict]) -> InvalidRequestError:
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return InvalidRequestError("the request body is not valid JSON")
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = first.get("msg", "invalid value")
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every non-2xx answer in OpenAI's shape, whatever raised it."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(list(exc.errors())))

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
        return error_response(as_api_error(exc))


def parse_body(model: type[BaseModel], body: dict):
    """Validates a body that did not come through FastAPI (in-process calls), with the same 400 as a router's."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(list(exc.errors())) from None

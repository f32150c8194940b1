"""One request, followed end to end: its ID, its log line and its trace, for every service (the gateway, the
reference engine, a draft worker); pure ASGI, the outermost layer, so that refusals and streams are followed too.

- The ID is the client's ``x-request-id`` where it is sane (at most 128 printable ASCII characters without
  spaces), else one made. Every answer echoes it (errors and streams too), every log line the request causes
  carries it, and the requests made on its behalf send it on (``outgoing_headers``): to the backend (vLLM takes
  ``X-Request-Id`` as its own request's ID) and to remote draft workers. A contextvar carries it, so the request's
  tasks, and the engine's or the draft's work done for it in the same process, see it unpassed.
- One log line per request (``specprefill.request``, JSON with ``--log-json``): ID, method, path, status,
  milliseconds, and what the app noted (``RequestRecord``: the model, the operation, the tokens) and its answer's
  ``x-specprefill-*`` headers say (plan, tokens, timings). Never a key, never prompt text.
- With OpenTelemetry configured (``common.tracing``), a server span per request, continuing the client's
  ``traceparent``, with the GenAI semantic conventions' attributes and the project's own; the app's child spans
  (draft, plan, backend) hang under it, and ``outgoing_headers`` carries its context on. The spans are made once
  the answer has gone (``RequestTrace.finish``). Off, nothing of OpenTelemetry is imported or made.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.tracing import RequestTrace, SpanWriter, enter, inject_context, leave

HEADER = "x-request-id"
_SANE = re.compile(rb"[!-~]{1,128}")  # printable ASCII, no spaces: safe in headers, log lines and JSON
_PLAN_HEADERS = {
    "x-specprefill-status": "compression",
    "x-specprefill-reason": "reason",
    "x-specprefill-plan": "plan",
    "x-specprefill-original-tokens": "original_tokens",
    "x-specprefill-kept-tokens": "kept_tokens",
    "x-specprefill-keep-rate": "keep_rate",
    "x-specprefill-cache": "score_cache",
    "x-specprefill-draft-ms": "draft_ms",
}
_TIMING = re.compile(r'(\w+);(?:dur=([\d.]+)|desc="([^"]*)")')
logger = logging.getLogger("specprefill.request")


@dataclass(slots=True)
class RequestRecord:
    """What the app learns of its request as it goes, for the log line and the span."""

    id: str
    model: str | None = None
    operation: str | None = None  # the GenAI operation: chat, text_completion
    usage: dict[str, int] = field(default_factory=dict)  # input, output, cached (tokens)
    trace: RequestTrace | None = None  # its spans, where tracing is on


_record: ContextVar[RequestRecord | None] = ContextVar("specprefill_request", default=None)


def current() -> RequestRecord | None:
    """The request this code runs for (None outside one)."""
    return _record.get()


def request_id() -> str | None:
    record = _record.get()
    return record.id if record is not None else None


def outgoing_headers() -> dict[str, str]:
    """Headers for a request made on this one's behalf: its ID, and its trace context where one is current."""
    record = _record.get()
    if record is None:
        return {}
    headers = {HEADER: record.id}
    if record.trace is not None:
        inject_context(headers)
    return headers


def sane_id(raw: bytes | None) -> str:
    """The client's ID where it is sane, else a new one."""
    if raw is not None and _SANE.fullmatch(raw):
        return raw.decode("ascii")
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Puts the current request's ID on every log record (``%(request_id)s``; ``-`` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id() or "-"
        return True


def note_usage(usage: Any) -> None:
    """The answer's token counts, in whichever API's names it gives them (OpenAI chat and completions,
    Responses, Anthropic)."""
    record = _record.get()
    if record is None or not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    counts = {
        "input": usage.get("prompt_tokens", usage.get("input_tokens")),
        "output": usage.get("completion_tokens", usage.get("output_tokens")),
        "cached": cached if cached is not None else usage.get("cache_read_input_tokens"),
    }
    if "cache_read_input_tokens" in usage and isinstance(counts["input"], int):  # Anthropic's input is the rest
        counts["input"] += int(usage.get("cache_read_input_tokens") or 0) + int(
            usage.get("cache_creation_input_tokens") or 0
        )
    record.usage.update({k: int(v) for k, v in counts.items() if isinstance(v, int)})


class RequestTelemetry:
    """The outermost middleware of a service: the request's ID, its log line, its server span."""

    def __init__(self, app: ASGIApp, writer: SpanWriter | None = None, *, log_json: bool = False) -> None:
        self.app = app
        self.writer = writer  # the service's span writer (common.tracing), or None: tracing off
        self.log_json = log_json

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        record = RequestRecord(sane_id(headers.get(HEADER.encode())))
        token = _record.set(record)
        span_token = self._start_span(record, scope, headers) if self.writer is not None else None
        answer: dict[str, Any] = {"status": None, "headers": {}}
        start = time.perf_counter()
        stamp = (HEADER.encode(), record.id.encode())

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message["headers"]}
                if HEADER not in answer["headers"]:
                    message = {**message, "headers": [*message["headers"], stamp]}
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        finally:
            milliseconds = (time.perf_counter() - start) * 1e3
            fields = self._fields(record, scope, answer, milliseconds)
            logger.info(json.dumps(fields) if self.log_json else _line(fields))
            if record.trace is not None and span_token is not None:
                leave(span_token)
                _end_span(record.trace, fields)
            _record.reset(token)

    def _start_span(self, record: RequestRecord, scope: Scope, headers: dict[bytes, bytes]) -> Any:
        assert self.writer is not None
        method, path = scope.get("method", "GET"), scope.get("path", "")
        attributes = {"http.request.method": method, "url.path": path, "specprefill.request_id": record.id}
        record.trace = self.writer.begin(f"{method} {path}", headers, attributes)
        return enter(record.trace)

    @staticmethod
    def _fields(record: RequestRecord, scope: Scope, answer: dict[str, Any], milliseconds: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": record.id,
            "method": scope.get("method"),
            "path": scope.get("path"),
            "status": answer["status"],
            "ms": round(milliseconds, 1),
        }
        if record.model is not None:
            out["model"] = record.model
        if record.operation is not None:
            out["operation"] = record.operation
        out |= {f"{k}_tokens": v for k, v in record.usage.items()}
        said = answer["headers"]
        out |= {name: said[h] for h, name in _PLAN_HEADERS.items() if h in said}
        for name, duration, description in _TIMING.findall(said.get("server-timing", "")):
            if name in ("backend", "predicted") and duration:
                out[f"{name}_ms"] = float(duration)
            elif name == "replica" and description:
                out["replica"] = description
        return out


def _line(fields: dict[str, Any]) -> str:
    return "request " + " ".join(f"{k}={v}" for k, v in fields.items())


GEN_AI = {"model": "gen_ai.request.model", "operation": "gen_ai.operation.name"}
GEN_AI_USAGE = {
    "input_tokens": "gen_ai.usage.input_tokens",
    "output_tokens": "gen_ai.usage.output_tokens",
    "cached_tokens": "gen_ai.usage.cache_read.input_tokens",
}
NUMBERS = ("original_tokens", "kept_tokens", "keep_rate", "draft_ms", "backend_ms", "predicted_ms")


def _end_span(trace: RequestTrace, fields: dict[str, Any]) -> None:
    """The server span's attributes from the request's log line, and every span of the request made and sent
    on: after the answer has gone."""
    from opentelemetry.trace import Status, StatusCode

    span = trace.server
    status = fields.get("status")
    attributes: dict[str, Any] = {"http.response.status_code": status} if status is not None else {}
    attributes |= {GEN_AI[k]: fields[k] for k in GEN_AI if k in fields}
    attributes |= {GEN_AI_USAGE[k]: fields[k] for k in GEN_AI_USAGE if k in fields}
    if "operation" in fields:
        attributes["gen_ai.provider.name"] = "specprefill"
    for key in ("compression", "reason", "plan", "score_cache", "replica"):
        if key in fields:
            attributes[f"specprefill.{key}"] = fields[key]
    for key in NUMBERS:
        if key in fields:
            attributes[f"specprefill.{key}"] = float(fields[key]) if "." in str(fields[key]) else int(fields[key])
    span.attributes |= attributes
    if status is None or status >= 500:
        span.status = Status(StatusCode.ERROR)
    span.end = time.time_ns()
    trace.finish()

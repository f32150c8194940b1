"""Running an app: request-size limits, in-flight tracking, and a graceful drain on SIGTERM.

On the first SIGTERM (or SIGINT) the server keeps listening but answers new requests 503 (``/health``
too, so load balancers take it out), lets in-flight requests and streams finish for up to
``drain_timeout`` seconds, then ends what is still in flight in its API's shape (a 503 with ``Retry-After``, or a
stream's error event) and stops: with status 0 where nothing had to be ended. A second signal stops it at once.
A signal before it serves (loading models, the start-up probe) stops it at once too, with status 128 + the
signal's number: there is nothing to drain.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import OverloadedError, error_body
from common.messages import error_body as anthropic_error_body
from common.options import ServerOptions
from common.streams import SSE_DONE, sse_error
from common.telemetry import RequestIdFilter, RequestTelemetry
from common.tracing import Tracing

logger = logging.getLogger("specprefill")
TRIM_AFTER_BYTES = 1 << 20  # a body at least this big: the heap is trimmed once its request is done


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere): hands freed heap pages back to the system. A refused 15 MB body
    left 30-130 MiB behind without it (its text, its parse, its pydantic copy: freed, but kept by the allocator)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def _give_back_memory() -> None:
    """After a big body: its copies freed now (a refused request's traceback holds its frames, and so the body,
    in a cycle until the collector runs) and the heap trimmed. Measured on a gateway: 25 refused 5-15 MB bodies
    took it from 456 to 590 MiB without this, to 455-465 MiB with it; the collection takes milliseconds (the
    start-up objects are frozen out of it)."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


class GuardMiddleware:
    """Pure ASGI: caps request headers (431) and body (413), counts in-flight requests, refuses new ones while
    draining (503). Every refusal is in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = 16 << 20, max_header_bytes: int = 64 << 10) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.in_flight = 0
        self.draining = False
        self.requests: set[_InFlight] = set()

    async def cut_off(self, timeout: float = 5.0) -> int:
        """Ends every request still in flight, each in its API's shape (the drain ran out of time): a 503 with
        ``Retry-After`` where nothing was sent yet, an error event (and ``[DONE]``, on OpenAI's chat and
        completions streams) where a stream had begun. Returns how many it ended."""
        tasks = [(r, r.task) for r in self.requests if r.task is not None and not r.task.done()]
        for request, task in tasks:
            request.cut = True
            task.cancel()
        deadline = asyncio.get_running_loop().time() + timeout
        while self.requests and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return len(tasks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (refusal := self._refusal(scope)) is not None:
            return await _send_error(send, *refusal)
        request = _InFlight(scope.get("path", ""))
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
                if not message.get("more_body", False):
                    request.read_at = time.perf_counter()
            return message

        self.in_flight += 1
        self.requests.add(request)
        # the request's own task: the drain cancels it here (a task of its own for the app was a task more a request)
        request.task = asyncio.current_task()
        try:
            await self.app(scope, limited_receive, _tracking(send, request))
        except _BodyTooLarge:
            if not request.started:
                await _send_error(send, *self._too_large())
        except asyncio.CancelledError:
            if not request.cut:
                raise
            if request.task is not None:
                request.task.uncancel()  # the drain's: answered below, nothing after it is cancelled
            await _cut_off(send, request)
        finally:
            self.requests.discard(request)
            self.in_flight -= 1
            if received >= TRIM_AFTER_BYTES:
                _give_back_memory()

    def _refusal(self, scope: Scope) -> tuple[Any, ...] | None:
        """Why a request is refused before the app sees it (``_send_error``'s arguments), or None."""
        if self.draining:
            return (
                503,
                "the server is shutting down; retry on another replica",
                "overloaded_error",
                {"retry-after": "1"},
            )
        if sum(len(k) + len(v) for k, v in scope["headers"]) > self.max_header_bytes:
            return 431, f"the request headers are larger than {self.max_header_bytes} bytes", "invalid_request_error"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> tuple[Any, ...]:
        return 413, f"the request body is larger than {self.max_body_bytes} bytes", "invalid_request_error"


def _tracking(send: Send, request: _InFlight) -> Send:
    """``send``, noting what the answer has sent so far in ``request``."""

    async def tracking_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            request.started = True
            headers = message.get("headers", ())
            if request.read_at is not None and not any(k.lower() == b"server-timing" for k, _ in headers):
                # an answer without the plan's timings (an error, above all): the gateway's own time for it,
                # from the body's last byte to this status line
                took = (time.perf_counter() - request.read_at) * 1e3
                message = {**message, "headers": [*headers, (b"server-timing", f"app;dur={took:.1f}".encode())]}
            request.stream = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            request.ended = True
        await send(message)

    return tracking_send


class _BodyTooLarge(Exception):
    pass


@dataclass(eq=False)
class _InFlight:
    """A request the guard is watching: where its answer stands, for ending it in shape if the drain runs out."""

    path: str
    task: asyncio.Future[Any] | None = None
    started: bool = False  # the response's status line went out
    stream: bool = False  # as server-sent events
    ended: bool = False  # its last byte went out
    cut: bool = False  # cancelled by the drain
    read_at: float | None = None  # when the body's last byte arrived (perf_counter)


DRAIN_MESSAGE = "the server shut down before this request was answered; retry it on another replica"


async def _cut_off(send: Send, request: _InFlight) -> None:
    """A request the drain cancelled, answered in its API's shape (Anthropic's on ``/v1/messages``, OpenAI's
    elsewhere)."""
    if request.ended:
        return
    anthropic = request.path.endswith("/messages")
    error = OverloadedError(DRAIN_MESSAGE, headers={"retry-after": "1"})
    if not request.started:
        body = anthropic_error_body(error) if anthropic else error.body()
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"retry-after", b"1"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
    elif request.stream:
        if anthropic:
            frame = sse_error(error, named=True, shape=anthropic_error_body)
        else:
            responses = request.path.endswith("/responses")
            frame = sse_error(error, named=responses) + (b"" if responses else SSE_DONE)
        await send({"type": "http.response.body", "body": frame})
    else:
        await send({"type": "http.response.body", "body": b""})


async def _send_error(
    send: Send, status: int, message: str, error_type: str, headers: dict[str, Any] | None = None
) -> None:
    body = json.dumps(error_body(message, error_type)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        guard: GuardMiddleware,
        drain_timeout: float,
        on_serving: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.guard = guard
        self.drain_timeout = drain_timeout
        self.on_serving = on_serving
        self._drain_task: asyncio.Task[Any] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # the app's lifespan: models, tokenizers, caches
        freeze_startup_heap()
        if self.on_serving is not None and self.started:
            self.on_serving()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.started:  # still starting (models, the start-up probe: minutes on CPU cores): nothing to drain
            logger.warning("stopping: a signal before the server was up (nothing served, nothing to drain)")
            logging.shutdown()
            # at once: uvicorn would stop only once the start-up had finished, and unwinding it waits for the forward
            # a thread is in (seconds on CPU cores) and logs the lifespan's cancellation as a failure
            os._exit(128 + sig)
        if self.guard.draining:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        self.guard.draining = True
        logger.warning(
            "draining: refusing new requests, waiting up to %.0f s for %d in flight",
            self.drain_timeout,
            self.guard.in_flight,
        )
        self._drain_task = asyncio.get_event_loop().create_task(self._drain(sig, frame))

    async def _drain(self, sig: int, frame: FrameType | None) -> None:
        deadline = asyncio.get_running_loop().time() + self.drain_timeout
        while self.guard.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        clean = self.guard.in_flight == 0
        if not clean:
            ended = await self.guard.cut_off()
            logger.warning(
                "drain: %.0f s passed; %d requests still in flight were ended with a 503 or an error event",
                self.drain_timeout,
                ended,
            )
        super().handle_exit(sig, frame)
        if clean:  # every request answered: exit 0, not by the signal uvicorn would raise again on its way out
            self._captured_signals.clear()


def freeze_startup_heap() -> None:
    """Moves every object alive after start-up out of the garbage collector's sight, as vLLM does after loading.

    Imports, models and tokenizers leave some 400,000 tracked objects, and a full collection walked them all:
    180 ms on this machine, at a moment no one chooses, so inside whichever request was running (the same
    cached request took 190 ms, or 400). Frozen, they are never walked again; they live as long as the
    process anyway.
    """
    gc.collect()
    gc.freeze()


def run_server(
    app: ASGIApp,
    options: ServerOptions,
    *,
    service: str = "specprefill",
    max_body_bytes: int = 16 << 20,
    max_header_bytes: int = 64 << 10,
    sockets: list[socket.socket] | None = None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serves ``app`` behind the guard and the request's telemetry (its ID, its log line, its trace:
    ``common.telemetry``), with logging configured the same way for every service. ``sockets``: already bound
    ones to serve on (a worker of ``common.workers``); ``on_serving``: called once it serves."""
    logging.basicConfig(
        level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    tracing = Tracing(service, options.otlp_endpoint)
    guard = GuardMiddleware(app, max_body_bytes=max_body_bytes, max_header_bytes=max_header_bytes)
    config = uvicorn.Config(
        RequestTelemetry(guard, tracing.writer, log_json=options.log_json),
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        h11_max_incomplete_event_size=max_header_bytes,
        timeout_graceful_shutdown=5,
        # idle keep-alive longer than a typical load balancer's (60 s), so a client never
        # sends on a connection the server is closing at that instant
        timeout_keep_alive=75,
    )
    try:
        DrainingServer(config, guard, options.drain_timeout, on_serving).run(sockets)
    finally:
        tracing.shutdown()

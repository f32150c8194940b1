"""Backends: where the gateway sends prompts. Each answers OpenAI completions and chat as plain dicts.

- ``InProcessBackend``: the reference engine in this process (the embedded default), no HTTP.
- ``HTTPBackend``: any server over HTTP. Its kind says what it can do and how kept tokens travel (``kinds``).

Errors come out typed: unreachable -> 502, timed out -> 504, a backend 4xx passes through unchanged. A backend
that refused the connection or dropped it raises ``BackendGone`` (a 502): before the first event of an answer
nothing has reached the client, so the request may go to another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import aiohttp
from pydantic import BaseModel

from common.errors import APIError, NotFoundError, OverloadedError, UpstreamError, parse_body
from common.json_wire import dumps, loads
from common.messages import MessagesRequest
from common.protocol import ChatCompletionRequest
from common.responses import ResponsesRequest
from common.telemetry import outgoing_headers
from engine.protocol import EngineCompletionRequest
from engine.serving import EngineServing
from gateway.engines.kinds import KINDS, Kind

# idle connections to a backend are closed by the gateway before the backend closes them: vLLM closes its idle
# connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and a request sent on one just as vLLM closes it fails
# before it is read (a 502, or a stream cut at its start). Kept 60 s, that race cost a chaos run with one core
# busy a 502 and a broken stream while nothing was down; a new loopback connection costs well under 1 ms.
KEEPALIVE_S = 4.0
JSON_HEADERS = {"content-type": "application/json"}  # a body goes as the bytes ``common.json_wire`` makes


class BackendGone(UpstreamError):
    """The backend refused the connection or dropped it (its process died, say)."""


class StreamRefused(UpstreamError):
    """A stream whose first event is an error: the backend refused the request after its 200 (vLLM's Messages
    stream does so for a swap it refuses), before the client saw anything."""


class Backend(Protocol):
    kind: Kind

    async def model_name(self) -> str: ...

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """A ``/v1/completions`` answer (warming pieces and probes)."""
        ...

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """An endpoint's (``gateway.dispatch.answer.Endpoint``) answer, whole."""
        ...

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """An endpoint's stream of events, open: its first event has come."""
        ...

    async def ready(self) -> bool: ...

    async def cache_shape(self) -> tuple[int, int] | None:
        """The engine's prefix-cache block size and capacity in tokens, where it says (None: unknown)."""
        ...

    async def load(self) -> int | None:
        """The requests the engine runs or queues now, from all its clients, where it says (None: unknown)."""
        ...

    async def kv_event_sources(self) -> dict[str, Any]:
        """Where the engine publishes its KV cache events, by data-parallel rank (vLLM's ``/kv_event_sources``:
        each its ``KVEventsConfig``); empty where it publishes none."""
        ...

    async def close(self) -> None: ...


class InProcessBackend:
    kind = KINDS["reference"]

    def __init__(self, serving: EngineServing) -> None:
        self.serving = serving

    async def model_name(self) -> str:
        return self.serving.model_name

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.serving.completion(parse_body(EngineCompletionRequest, body))

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        model, whole, _ = self._endpoint(path)
        answer: dict[str, Any] = await whole(parse_body(model, body))
        return answer

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        model, _, streamed = self._endpoint(path)
        stream: AsyncGenerator[dict[str, Any], None] = await streamed(parse_body(model, body))
        return stream

    def _endpoint(self, path: str) -> tuple[type[BaseModel], Callable[..., Any], Callable[..., Any]]:
        """The request model and the serving calls (whole, streamed) of the engine's endpoint at ``path``."""
        serving = self.serving
        endpoints: dict[str, tuple[type[BaseModel], Callable[..., Any], Callable[..., Any]]] = {
            "/v1/completions": (EngineCompletionRequest, serving.completion, serving.completion_stream),
            "/v1/chat/completions": (ChatCompletionRequest, serving.chat_completion, serving.chat_completion_stream),
            "/v1/responses": (ResponsesRequest, serving.responses, serving.responses_stream),
            "/v1/messages": (MessagesRequest, serving.messages, serving.messages_stream),
        }
        if path not in endpoints:
            raise NotFoundError(f"the reference engine does not serve {path}")
        return endpoints[path]

    async def ready(self) -> bool:
        return True

    async def cache_shape(self) -> tuple[int, int] | None:
        return self.serving.engine.cache_shape()

    async def load(self) -> int | None:
        return self.serving.engine.active

    async def kv_event_sources(self) -> dict[str, Any]:
        return {}  # in-process, the engine's cache is the gateway's to read; no model needs its events

    async def close(self) -> None:
        self.serving.close()


class HTTPBackend:
    """A backend over HTTP, through one ``aiohttp`` session of keep-alive connections. (aiohttp rather than
    httpx, the project's client elsewhere: on the hop every forwarded request takes, it measured 1.2 ms less
    per streamed request, 2.0 against 3.2 ms with a 12,000-token body, and that hop is most of the gateway's
    own time on a cached request it sends whole.)"""

    def __init__(
        self,
        base_url: str,
        kind: str | Kind,
        *,
        model: str | None = None,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        rank: int | None = None,
    ) -> None:
        self.kind = kind if isinstance(kind, Kind) else KINDS[kind]
        self.base_url = base_url.rstrip("/")
        self.rank = rank  # vLLM's data-parallel rank every request goes to (None: vLLM balances them)
        self._model = model
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if rank is not None:
            self._headers["X-data-parallel-rank"] = str(rank)
        # connect covers waiting for a free connection too, as httpx's pool timeout did
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._session: aiohttp.ClientSession | None = None  # made in the event loop, at the first request
        self._timeouts = (connect_timeout, read_timeout)

    def for_rank(self, rank: int) -> HTTPBackend:
        """The same server, each request sent to data-parallel rank ``rank`` (vLLM's ``X-data-parallel-rank``)."""
        return HTTPBackend(
            self.base_url,
            self.kind,
            model=self._model,
            api_key=self._api_key,
            connect_timeout=self._timeouts[0],
            read_timeout=self._timeouts[1],
            rank=rank,
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=KEEPALIVE_S),
            )
        return self._session

    async def model_name(self) -> str:
        if self._model is None:
            models = (await self._request("GET", "/v1/models")).get("data") or []
            if not models:
                raise UpstreamError("the backend serves no model")
            self._model = models[0]["id"]
        return self._model

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", "/v1/completions", body)

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", path, body)

    async def stream(self, path: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        return await self._stream(path, body)

    async def ready(self) -> bool:
        return await self._get_text("/health", 2.0) is not None

    async def cache_shape(self) -> tuple[int, int] | None:
        """From the engine's /metrics: vLLM's ``vllm:cache_config_info``, or the reference engine's."""
        text = await self._get_text("/metrics", 5.0)
        return parse_cache_shape(text) if text is not None else None

    async def load(self) -> int | None:
        """From the engine's /metrics: vLLM's running and waiting requests (its rank's), or the reference
        engine's."""
        text = await self._get_text("/metrics", 2.0)
        return parse_load(text, self.rank) if text is not None else None

    async def kv_event_sources(self) -> dict[str, Any]:
        text = await self._get_text("/kv_event_sources", 5.0)
        try:
            sources = json.loads(text) if text is not None else {}
        except json.JSONDecodeError:
            return {}
        return sources if isinstance(sources, dict) else {}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _get_text(self, path: str, timeout: float) -> str | None:
        """A GET answered 200 within ``timeout`` seconds, as text; None otherwise."""
        try:
            async with self.session.get(self.base_url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return await r.text() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    async def _open(self, method: str, path: str, body: dict[str, Any] | None = None) -> aiohttp.ClientResponse:
        """The backend's response once its status is 200 (its body unread); any other status a typed error."""
        try:
            response = await self.session.request(
                method,
                self.base_url + path,
                data=None if body is None else dumps(body),
                headers={**JSON_HEADERS, **outgoing_headers()} if body is not None else outgoing_headers(),
            )
            if response.status != 200:
                with contextlib.closing(response):
                    raise _status_error(response.status, await response.read(), response.headers.get("retry-after"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _transport_error(exc) from None
        return response

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = await self._open(method, path, body)
        try:
            async with response:
                content = await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _transport_error(exc) from None
        try:
            answer = loads(content)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):  # an event stream, say, where a JSON answer was asked for
            kind = response.headers.get("content-type", "no content type")
            raise UpstreamError(
                f"the backend's answer to {method} {path} is not a JSON object ({kind}: {content[:80]!r})",
                code="backend_error",
            )
        return answer

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Opens the stream and reads up to its first event past the preamble (``PREAMBLE_EVENTS``: what a backend
        sends before it has read the prompt), so that backend errors surface before any byte: an error event
        there, or a stream broken after the preamble, is ``StreamRefused`` (vLLM 0.32 checks a Responses swap only
        after ``response.created`` and, refusing it, drops the connection)."""
        events = _sse_events(await self._open("POST", path, body))
        head: list[dict[str, Any]] = []
        try:
            while not head or head[-1].get("type") in PREAMBLE_EVENTS:
                head.append(await anext(events))
        except StopAsyncIteration:
            await events.aclose()
            if not head:
                raise BackendGone("the backend closed the stream without an answer", code="backend_error") from None
        except UpstreamError as exc:
            await events.aclose()
            if type(exc) is UpstreamError or head:  # an error event, or a stream broken before any output
                raise StreamRefused(exc.message, code=exc.code) from None
            raise
        except BaseException:
            await events.aclose()
            raise
        return _chained(head, events)


async def _chained(
    head: list[dict[str, Any]], rest: AsyncGenerator[dict[str, Any], None]
) -> AsyncGenerator[dict[str, Any], None]:
    """``head``'s events, then ``rest``; closing this closes ``rest``."""
    try:
        for event in head:
            yield event
        async for event in rest:
            yield event
    finally:
        await rest.aclose()


# what a backend streams before it has read the prompt (OpenAI's Responses, Anthropic's Messages): no output yet
PREAMBLE_EVENTS = ("response.created", "response.in_progress", "message_start", "ping")


# streams that end with an event of their own, without [DONE]: OpenAI's Responses, Anthropic's Messages
LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed", "message_stop")


def parse_cache_shape(metrics: str) -> tuple[int, int] | None:
    """(block size, capacity in tokens) from Prometheus text; capacity 0 where prefix caching is off."""
    for line in metrics.splitlines():
        name, _, rest = line.partition("{")
        if name not in ("vllm:cache_config_info", "specprefill_engine_cache_info"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest.rpartition("}")[0]))
        try:
            block_size = int(labels["block_size"])
            if name == "specprefill_engine_cache_info":
                return block_size, int(labels["capacity_tokens"])
            enabled = labels.get("enable_prefix_caching", "True") == "True"
            return block_size, block_size * int(labels.get("num_gpu_blocks") or 0) if enabled else 0
        except (KeyError, ValueError):
            return None
    return None


LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "specprefill_engine_active_requests")


def parse_load(metrics: str, rank: int | None = None) -> int | None:
    """Requests running or waiting, summed over the engine's series, or over data-parallel rank ``rank``'s
    (vLLM labels each rank's ``engine="N"``); None where it exports none."""
    total, found = 0.0, False
    for line in metrics.splitlines():
        if line.partition("{")[0].partition(" ")[0] in LOAD_METRICS:
            if rank is not None and f'engine="{rank}"' not in line:
                continue
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except (IndexError, ValueError):
                continue
    return round(total) if found else None


async def _sse_events(response: aiohttp.ClientResponse) -> AsyncGenerator[dict[str, Any], None]:
    try:
        async for line in _lines(response.content):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                await _drained(response)
                return
            event = loads(data)
            if "error" in event or event.get("type") == "error":
                error = event.get("error") or event
                raise UpstreamError(f"the backend failed mid-stream: {error.get('message', 'unknown error')}")
            yield event
            if event.get("type") in LAST_EVENTS:
                return
        raise UpstreamError("the backend's stream ended without [DONE]")
    except asyncio.TimeoutError as exc:
        raise _transport_error(exc) from None
    except aiohttp.ClientError as exc:
        raise BackendGone(
            f"the backend connection broke mid-stream ({type(exc).__name__})", code="backend_error"
        ) from None
    finally:
        response.release()  # read to its end, the connection goes back to the pool; else it is closed


async def _drained(response: aiohttp.ClientResponse) -> None:
    """The body's last bytes after ``[DONE]`` (the chunked terminator), so that the connection can be reused."""
    with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
        await asyncio.wait_for(response.content.read(), 1.0)


async def _lines(content: aiohttp.StreamReader) -> AsyncGenerator[bytes, None]:
    """The body's lines as they arrive, however long (aiohttp's own line reader refuses lines over 128 KiB,
    and one Responses event carries the whole answer)."""
    pending = b""
    async for data in content.iter_any():
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


def _transport_error(exc: Exception) -> APIError:
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return BackendGone("the backend is unreachable", code="backend_unreachable")
    if isinstance(exc, asyncio.TimeoutError):  # a read timed out (aiohttp's SocketTimeoutError is one)
        return UpstreamError("the backend did not answer in time", status_code=504, code="backend_timeout")
    return BackendGone(f"the backend connection failed: {type(exc).__name__}", code="backend_error")


def _status_error(status: int, content: bytes, retry_after: str | None = None) -> APIError:
    """A backend's non-200 answer as the error the client gets: its own mistakes passed through, an engine's
    "busy, retry" (429, 503) passed through with its Retry-After (a 502 would tell clients the gateway broke),
    any other failure a 502."""
    try:
        error = json.loads(content).get("error") or {}  # OpenAI's shape, or Anthropic's (``{"type": "error", ...}``)
    except (ValueError, AttributeError):
        error = {}
    if not isinstance(error, dict):
        error = {}
    message = error.get("message") if isinstance(error.get("message"), str) else None
    if 400 <= status < 500:  # the client's mistake, as the backend saw it: pass it through
        # vLLM's errors name the parameter in the message too, and Anthropic's shape only there
        named = re.search(r"\(parameter=([\w.\-\[\]]+)", message or "")
        exc = APIError(
            message or f"the backend rejected the request ({status})",
            status_code=status,
            param=error.get("param") or (named.group(1) if named else None),
            code=error.get("code"),
        )
        exc.error_type = error.get("type") or "invalid_request_error"
        if retry_after:
            exc.headers = {"retry-after": retry_after}
        return exc
    if status == 503:  # overloaded (the reference engine's full queue): the client retries later, as from direct
        return OverloadedError(
            f"the backend is overloaded: {message or 'no details'}",
            code=error.get("code") or "backend_overloaded",
            headers={"retry-after": retry_after or "1"},
        )
    return UpstreamError(f"the backend failed ({status}): {message or 'no details'}", code="backend_error")

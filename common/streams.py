"""Server-sent events and async-stream helpers shared by every service."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from common.cancellation import DisconnectWatch
from common.errors import APIError, as_api_error
from common.json_wire import dumps
from common.ready_runs import in_runs

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any], named: bool = False) -> bytes:
    """One frame; ``named`` streams (OpenAI's Responses events) also carry the payload's type as the event name."""
    head = f"event: {payload.get('type')}\n".encode() if named else b""
    return head + b"data: " + dumps(payload) + b"\n\n"


def sse_error(
    exc: BaseException, named: bool = False, shape: Callable[[APIError], dict[str, Any]] | None = None
) -> bytes:
    """The frame sent when a stream has already begun: one error event (then the caller sends [DONE]);
    ``shape`` renders it in another API's error shape (an Anthropic stream's ``error`` event)."""
    error = as_api_error(exc)
    if shape is not None:
        return sse(shape(error), named=named)
    body = error.body()
    if named:  # the Responses stream's error event
        return sse({"type": "error", **body["error"]}, named=True)
    return sse(body)


async def prepend(
    first: dict[str, Any], rest: AsyncGenerator[dict[str, Any], None]
) -> AsyncGenerator[dict[str, Any], None]:
    """``first``, then ``rest``; closing this closes ``rest`` (and whatever request it holds open)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def merge(streams: list[AsyncGenerator[Any, None]]) -> AsyncGenerator[tuple[int, Any], None]:
    """``(index, item)`` from several streams as each comes; one stream is passed through without tasks.
    The first failure ends the merge; closing it closes every stream."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncGenerator[Any, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except BaseException as exc:
            await queue.put((index, exc))
            raise
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_body(
    chunks: AsyncGenerator[dict[str, Any], None],
    *,
    on_first: Callable[[], None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    on_done: Callable[[], None] | None = None,
    named: bool = False,
    error_shape: Callable[[APIError], dict[str, Any]] | None = None,
) -> AsyncGenerator[bytes, None]:
    """``chunks`` as SSE frames, then ``[DONE]``; the hooks observe the first chunk, a failure, a clean end.
    ``named``: an event name on each frame, and no ``[DONE]`` (OpenAI's Responses stream, Anthropic's Messages
    stream); ``error_shape``: the error event in another API's shape.

    A failure after the first byte cannot change the HTTP status any more: it becomes one error event,
    then ``[DONE]``.
    """
    first = True
    try:
        async for chunk in chunks:
            if first and on_first is not None:
                on_first()
            first = False
            yield sse(chunk, named)
        if on_done is not None:
            on_done()
    except Exception as exc:
        if on_error is not None:
            on_error(exc)
        yield sse_error(exc, named, error_shape)
    finally:
        await chunks.aclose()
    if not named:
        yield SSE_DONE


class EventStreamResponse(StreamingResponse):
    """An event stream (``sse_body``'s frames) as an HTTP response, with what Starlette's ``StreamingResponse``
    spends on every stream left out: under an ASGI server of spec 2.3 (uvicorn) it runs the stream in an anyio
    task group beside a task that listens for the disconnect, writes every frame on its own, and ends every
    response with an empty message, one more write to the socket. Here one ``DisconnectWatch`` cancels the stream
    when its client leaves (the backend's request is closed by the stream's ``finally``); the frames that are ready
    one after another (a backend read that held several events) go out in one write, made before the next frame is
    waited for (``in_runs``); and ``[DONE]``, the last frame by the protocol, ends the response in its write. A
    named stream (no ``[DONE]``) ends with its last run, or an empty message."""

    media_type = "text/event-stream"
    watch: DisconnectWatch | None = None  # the handler's, handed over (``with_cancellation``): one a request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        async with self.watch or DisconnectWatch(receive) as watch:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            ended = False

            async def write(run: list[Any], last: bool) -> None:
                nonlocal ended
                if ended:
                    return  # nothing follows [DONE] on the wire
                frames = [chunk.encode(self.charset) if isinstance(chunk, str) else bytes(chunk) for chunk in run]
                if SSE_DONE in frames:
                    del frames[frames.index(SSE_DONE) + 1 :]
                    ended = True
                if ended or last:
                    watch.closing()
                elif not frames:
                    return
                ended = ended or last
                body = frames[0] if len(frames) == 1 else b"".join(frames)
                await send({"type": "http.response.body", "body": body, "more_body": not ended})

            await in_runs(aiter(self.body_iterator), write)
        if self.background is not None and not watch.gone:
            await self.background()

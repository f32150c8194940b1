"""Server-sent events and async-stream helpers shared by every service."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from common.errors import as_api_error

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    """The frame sent when a stream has already begun: one error event (then the caller sends [DONE])."""
    return sse(as_api_error(exc).body())


async def prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """``first``, then ``rest``; closing this closes ``rest`` (and whatever request it holds open)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def sse_body(chunks: AsyncIterator[dict], *, on_first: Callable[[], None] | None = None,
                   on_error: Callable[[BaseException], None] | None = None,
                   on_done: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
    """``chunks`` as SSE frames, then ``[DONE]``; the hooks observe the first chunk, a failure, a clean end.

    A failure after the first byte cannot change the HTTP status any more: it becomes one error event,
    then ``[DONE]``.
    """
    first = True
    try:
        async for chunk in chunks:
            if first and on_first is not None:
                on_first()
            first = False
            yield sse(chunk)
        if on_done is not None:
            on_done()
    except Exception as exc:
        if on_error is not None:
            on_error(exc)
        yield sse_error(exc)
    finally:
        await chunks.aclose()
    yield SSE_DONE

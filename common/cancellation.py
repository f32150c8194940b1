"""Cancellation of non-streaming handlers when their client disconnects."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response


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

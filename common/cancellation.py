"""Work cancelled when its client disconnects: a handler before it answers, a stream while it is sent."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive


class DisconnectWatch:
    """Inside it, the current task is cancelled when its client disconnects (the ASGI ``http.disconnect``), and
    the block ends quietly there (``gone``); any other cancellation passes through.

    One watcher task reads the receive channel beside the work, in place of a task for the work beside one for
    the watcher (``asyncio.wait``) or Starlette's task group around a stream: a task and a cancel scope fewer a
    request. The request body must already have been read, so the watcher only sees the disconnect. ASGI servers
    also answer ``receive`` with ``http.disconnect`` once the response is complete: ``closing`` before the last
    message keeps that from cancelling anything."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._closing = False
        self.gone = False  # the client left while the block ran

    async def __aenter__(self) -> DisconnectWatch:
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._closing and self._task is not None:
            self.gone = True
            self._task.cancel()

    def closing(self) -> None:
        """The response's last message is next: the server's end of the exchange is no disconnect."""
        self._closing = True

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self._watcher.cancel()
        if not self.gone or self._task is None:
            return False
        self._task.uncancel()  # ours: whatever the work made of it, nothing after the block is cancelled
        return kind is asyncio.CancelledError


def with_cancellation(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Cancels a handler when its client disconnects before it answers.

    Starlette does not notice a disconnect until it writes the response, so a long generation would run
    to the end for nobody. ``http.disconnect`` cancels the handler, whose ``finally`` blocks release the work (the
    engine drops the sequence, the gateway closes its backend request), and the answer is a 499 for nobody.
    A streamed answer is watched again while it is sent (``common.streams.EventStreamResponse``).
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        request: Request = kwargs["raw_request"]
        async with DisconnectWatch(request.receive):
            return await handler(*args, **kwargs)
        return Response(status_code=499)  # the client left: the watch ended the handler

    return wrapper

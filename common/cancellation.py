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
    message keeps that from cancelling anything.

    A handler's watch goes on to its streamed response (``handed_over``, then the response's own block): one
    watcher a request. Between the two blocks a disconnect cancels nothing; the response's block sees ``gone``."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._closing = False
        self._inside = False
        self._kept = False
        self._cancelled = False  # this watch cancelled the task (once: the block's exit takes it back)
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Future[None] | None = None
        self.gone = False  # the client left while the block ran

    async def __aenter__(self) -> DisconnectWatch:
        self._task, self._inside, self._kept = asyncio.current_task(), True, False
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        elif self.gone:  # the client left between the blocks: this one is cancelled where it first waits
            self._cancel()
        return self

    def _cancel(self) -> None:
        if self._task is not None and not self._cancelled:
            self._cancelled = True
            self._task.cancel()

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if self._closing:
            return
        self.gone = True
        if self._inside:
            self._cancel()

    def closing(self) -> None:
        """The response's last message is next: the server's end of the exchange is no disconnect."""
        self._closing = True

    def handed_over(self) -> DisconnectWatch:
        """This watch kept watching past its block, for another block to enter (the handler's, for its
        streamed response)."""
        self._kept = True
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self._inside = False
        if not self._kept and self._watcher is not None:
            self._watcher.cancel()
        if not self._cancelled or self._task is None:
            return False
        self._cancelled = False
        self._task.uncancel()  # ours: whatever the work made of it, nothing after the block is cancelled
        return kind is asyncio.CancelledError


def with_cancellation(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Cancels a handler when its client disconnects before it answers.

    Starlette does not notice a disconnect until it writes the response, so a long generation would run
    to the end for nobody. ``http.disconnect`` cancels the handler, whose ``finally`` blocks release the work (the
    engine drops the sequence, the gateway closes its backend request), and the answer is a 499 for nobody.
    A streamed answer (``common.streams.EventStreamResponse``: it has ``watch``) is watched on by the same watch
    while it is sent.
    """

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        request: Request = kwargs["raw_request"]
        async with DisconnectWatch(request.receive) as watch:
            response = await handler(*args, **kwargs)
            if hasattr(response, "watch"):
                response.watch = watch.handed_over()
            return response
        return Response(status_code=499)  # the client left: the watch ended the handler

    return wrapper

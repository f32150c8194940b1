"""``DisconnectWatch``: one watcher a request, from the handler to its streamed response; a client that leaves
between the two still ends the response's stream, and its ``finally`` runs."""

from __future__ import annotations

import asyncio

from common.cancellation import DisconnectWatch, with_cancellation
from common.streams import EventStreamResponse, sse_body
from tests.common.test_streams import stalling


class _Client:
    """An ASGI receive channel: the body, then nothing until ``leave()`` (then ``http.disconnect``)."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.body_read = False

    async def receive(self) -> dict:
        if not self.body_read:
            self.body_read = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}


class _Request:
    def __init__(self, receive) -> None:
        self.receive = receive


async def test_the_handlers_watch_goes_on_to_its_stream_one_watcher_a_request():
    client, state, sent = _Client(), {}, []
    await client.receive()  # the body, read by the app before the handler

    @with_cancellation
    async def handler(raw_request):
        return EventStreamResponse(sse_body(stalling(state)))

    tasks_before = len(asyncio.all_tasks())
    response = await handler(raw_request=_Request(client.receive))
    assert response.watch is not None and len(asyncio.all_tasks()) == tasks_before + 1  # its watcher, still on

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body":
            client.left.set()  # the client leaves after the first frame

    await asyncio.wait_for(response({"type": "http"}, client.receive, send), 2)
    assert state["closed"] and response.watch.gone
    assert [m["body"] for m in sent if m["type"] == "http.response.body"] == [b'data: {"n":1}\n\n']
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == tasks_before  # the watcher is gone with the response


async def test_a_client_gone_between_the_handler_and_its_response_ends_the_stream():
    client, state, sent = _Client(), {}, []
    await client.receive()

    @with_cancellation
    async def handler(raw_request):
        return EventStreamResponse(sse_body(stalling(state)))

    response = await handler(raw_request=_Request(client.receive))
    client.left.set()
    await asyncio.sleep(0.01)  # the watcher sees it, outside any block: nothing is cancelled
    assert response.watch.gone

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(response({"type": "http"}, client.receive, send), 2)
    assert state["closed"]  # the stream was begun and closed: the backend request would be released
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # nothing after the response is cancelled


async def test_a_watch_not_handed_over_stops_its_watcher_at_the_blocks_end():
    client = _Client()
    await client.receive()
    tasks_before = len(asyncio.all_tasks())
    async with DisconnectWatch(client.receive):
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == tasks_before

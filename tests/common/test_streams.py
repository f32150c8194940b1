"""SSE framing shared by the engine and the gateway: an error after the first byte is one event, then [DONE]."""

from __future__ import annotations

import asyncio
import json

import httpx

from common.errors import InvalidRequestError
from common.streams import SSE_DONE, EventStreamResponse, prepend, sse_body
from tests.helpers import eventually, serve


async def _chunks(fail_with: Exception | None = None):
    yield {"n": 1}
    yield {"n": 2}
    if fail_with is not None:
        raise fail_with


async def stalling(state: dict):
    """An event, then a wait for the next that outlasts any test; ``state["closed"]`` once its ``finally`` ran."""
    try:
        yield {"n": 1}
        await asyncio.sleep(60)
        yield {"n": 2}
    finally:
        state["closed"] = True


async def _collect(stream) -> list[bytes]:
    return [frame async for frame in stream]


async def test_frames_then_done_and_the_hooks_see_each_moment():
    seen = []
    frames = await _collect(
        sse_body(
            _chunks(),
            on_first=lambda: seen.append("first"),
            on_error=lambda e: seen.append("error"),
            on_done=lambda: seen.append("done"),
        )
    )
    assert frames == [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', SSE_DONE]
    assert seen == ["first", "done"]


async def test_an_error_mid_stream_is_one_openai_error_event_then_done():
    errors = []
    frames = await _collect(sse_body(_chunks(InvalidRequestError("bad", param="x")), on_error=errors.append))
    assert frames[-1] == SSE_DONE and len(frames) == 4
    assert json.loads(frames[2][6:]) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "x", "code": None}
    }
    internal = await _collect(sse_body(_chunks(RuntimeError("secret detail"))))
    assert b"secret detail" not in internal[2] and b"internal server error" in internal[2]
    assert len(errors) == 1


async def test_prepend_closes_the_rest():
    closed = []

    async def rest():
        try:
            yield {"n": 2}
            yield {"n": 3}
        finally:
            closed.append(True)

    stream = prepend({"n": 1}, rest())
    assert await anext(stream) == {"n": 1} and await anext(stream) == {"n": 2}
    await stream.aclose()
    assert closed == [True]


def _stream_app(stream, messages: list[dict]):
    """An ASGI app answering every request with ``EventStreamResponse(sse_body(stream()))``, recording the ASGI
    messages it sends."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass

        async def recorded(message):
            messages.append(message)
            await send(message)

        await EventStreamResponse(sse_body(stream())).__call__(scope, receive, recorded)

    return app


def test_frames_ready_together_go_in_one_write_and_done_ends_the_response():
    """The first frame goes at once; the frames ready one after another behind it in one write; [DONE] is the last
    frame by the protocol: its write carries the end of the body (no empty message after it); the client reads
    every frame."""
    messages: list[dict] = []
    with serve(_stream_app(_chunks, messages)) as url:
        body = httpx.get(url).text
    assert body == 'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'
    bodies = [m for m in messages if m["type"] == "http.response.body"]
    assert [m["body"] for m in bodies] == [b'data: {"n":1}\n\n', b'data: {"n":2}\n\ndata: [DONE]\n\n']
    assert bodies[0]["more_body"] and not bodies[1]["more_body"]


def test_a_frame_that_waits_splits_the_writes():
    """A frame that is not ready yet: what was ready is written before it is waited for, then the rest."""

    async def paced():
        yield {"n": 1}
        await asyncio.sleep(0.01)
        yield {"n": 2}

    messages: list[dict] = []
    with serve(_stream_app(paced, messages)) as url:
        body = httpx.get(url).text
    assert body == 'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'
    bodies = [m["body"] for m in messages if m["type"] == "http.response.body"]
    assert bodies == [b'data: {"n":1}\n\n', b'data: {"n":2}\n\ndata: [DONE]\n\n']


async def test_a_client_that_leaves_ends_its_stream_at_once():
    """The stream waits for its next event when the client leaves: the watch cancels it there, and its
    ``finally`` (where the gateway closes its backend request) runs within a second."""
    state = {"closed": False}
    with serve(_stream_app(lambda: stalling(state), [])) as url:
        async with httpx.AsyncClient(timeout=10) as client, client.stream("GET", url) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break  # the first event: then the client leaves
        assert await eventually(lambda: state["closed"], within=1.0)

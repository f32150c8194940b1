"""SSE framing shared by the engine and the gateway: an error after the first byte is one event, then [DONE]."""

from __future__ import annotations

import json

from common.errors import InvalidRequestError
from common.streams import SSE_DONE, prepend, sse_body


async def _chunks(fail_with: Exception | None = None):
    yield {"n": 1}
    yield {"n": 2}
    if fail_with is not None:
        raise fail_with


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

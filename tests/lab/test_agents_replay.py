"""``specprefill bench agents --direct replay``: the requests an agent sent through one path go again, as
it sent them, to the other: the same bytes, in order, with the pauses the agent left between them."""

from __future__ import annotations

import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from specprefill_lab.agents import TimingProxy, Turn, replay_session
from tests.helpers import serve

EVENTS = (
    b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":7}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)


def recording_upstream() -> tuple[FastAPI, list[tuple[float, str, bytes, str | None]]]:
    app, seen = FastAPI(), []

    @app.post("/v1/messages")
    async def messages(request: Request) -> StreamingResponse:
        seen.append((time.perf_counter(), request.url.query, await request.body(), request.headers.get("x-beta")))
        return StreamingResponse(iter([EVENTS]), media_type="text/event-stream")

    return app, seen


def test_the_other_path_gets_the_same_requests_with_the_same_pauses():
    first_app, _ = recording_upstream()
    other_app, seen = recording_upstream()
    with serve(first_app) as first_url, serve(other_app) as other_url:
        agent_side, other_side = TimingProxy(first_url), TimingProxy(other_url)
        with agent_side.serving() as agent_proxy, other_side.serving() as other_proxy:
            bodies = [b'{"turn": 1, "request": 1}', b'{"turn": 1, "request": 2}', b'{"turn": 2}']
            for number, body in enumerate(bodies):
                if number == 2:
                    time.sleep(0.5)  # the user's think time before the next turn
                headers = {"content-type": "application/json", "x-beta": f"b{number}"}
                httpx.post(f"{agent_proxy}/v1/messages?beta=true", content=body, headers=headers)
            exchanges = agent_side.exchanges
            turns = [Turn("claude", "gateway", 0, 1, exchanges[:2]), Turn("claude", "gateway", 0, 2, exchanges[2:])]
            replayed = replay_session(turns, agent_side.sent, "direct", other_proxy, other_side)
    assert [body for _, _, body, _ in seen] == bodies
    assert {query for _, query, _, _ in seen} == {"beta=true"} and [b for *_, b in seen] == ["b0", "b1", "b2"]
    assert seen[2][0] - seen[1][0] >= 0.45  # the pause the agent left before its next turn
    assert [t.turn for t in replayed] == [1, 2] and [len(t.exchanges) for t in replayed] == [2, 1]
    assert all(t.path == "direct" and e.ttft_s is not None for t in replayed for e in t.exchanges)

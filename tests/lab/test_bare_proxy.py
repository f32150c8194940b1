"""The load rounds' floor (``specprefill_lab.bare_proxy``) is a proxy: it relays the backend's answers byte for byte."""

from __future__ import annotations

import asyncio

import aiohttp

from specprefill_lab.launch import launched_bare_proxy, launched_instant_backend
from specprefill_lab.rounds import BODY, closed_loop


async def _answer(url: str, body: dict) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            return response.status, response.headers["content-type"], await response.read()


def test_the_bare_proxy_relays_streamed_and_whole_answers_as_the_backend_gives_them():
    with launched_instant_backend() as (backend, _), launched_bare_proxy(backend) as (proxy, _):
        for stream in (True, False):
            body = {"model": "fast", **BODY, "stream": stream}
            direct, relayed = asyncio.run(_answer(backend, body)), asyncio.run(_answer(proxy, body))
            assert relayed == direct
            assert direct[0] == 200 and (b"data: [DONE]" in direct[2]) == stream
        loaded = asyncio.run(closed_loop(proxy, "fast", 8, 1.0, "floor"))
    assert loaded.errors == 0 and loaded.requests > 0, loaded.summary()

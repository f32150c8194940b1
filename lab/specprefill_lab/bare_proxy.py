"""The floor of a streaming proxy in Python: what the gateway's stack costs before the gateway does anything.

    .venv/bin/python -m specprefill_lab.bare_proxy PORT BACKEND_URL

A bare ASGI app under uvicorn (the gateway's server, with its defaults: uvloop, httptools) that sends every
request's body to ``BACKEND_URL`` with aiohttp (the gateway's client) and relays the answer's bytes as they come:
no parsing, no template, no tokens, no plan, no metrics. ``loadtest.py --floor`` measures it beside the gateway
in the same rounds, so the gateway's CPU a request reads against the least a proxy built of the same parts pays.
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn

from common.request_body import request_body


def make_app(backend_url: str):
    session: aiohttp.ClientSession | None = None

    async def app(scope, receive, send) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = await request_body(receive)
        if body is None:  # the client left
            return
        headers = {"content-type": "application/json"}
        async with session.post(backend_url + scope["path"], data=body, headers=headers) as answer:
            kind = answer.headers.get("content-type", "application/json").encode()
            await send({"type": "http.response.start", "status": answer.status, "headers": [(b"content-type", kind)]})
            async for chunk in answer.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    return app


if __name__ == "__main__":
    uvicorn.run(make_app(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)

"""A backend that answers at once (OpenAI completions and chat, streamed), so a load test measures the gateway.

.venv/bin/python -m specprefill_lab.fast_backend PORT [CHUNKS] [FIRST_MS]

``FIRST_MS``: milliseconds a stream waits before its first event (an engine's time to it; default 0).
"""

from __future__ import annotations

import asyncio
import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


async def _events(obj: str, delta, chunks: int, first_ms: float):
    """``chunks`` events of an ``obj`` stream, then [DONE], after ``first_ms`` milliseconds."""
    if first_ms:
        await asyncio.sleep(first_ms / 1e3)
    for i in range(chunks):
        choice = {"index": 0, **delta(i), "finish_reason": "length" if i == chunks - 1 else None}
        chunk = {"id": "x", "object": obj, "created": 0, "model": "fast", "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


def make_app(chunks: int = 8, first_ms: float = 0.0) -> Starlette:
    def stream(obj: str, delta):
        return _events(obj, delta, chunks, first_ms)

    async def completions(request: Request):
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(
                stream("text_completion", lambda i: {"text": f" t{i}", "logprobs": None}),
                media_type="text/event-stream",
            )
        return JSONResponse(
            {
                "id": "x",
                "object": "text_completion",
                "created": 0,
                "model": "fast",
                "choices": [{"index": 0, "text": " t", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def chat(request: Request):
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(
                stream("chat.completion.chunk", lambda i: {"delta": {"content": f" t{i}"}}),
                media_type="text/event-stream",
            )
        message = {"role": "assistant", "content": " t"}
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "fast",
                "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fast", "object": "model"}]})

    async def health(_: Request):
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
        ]
    )


if __name__ == "__main__":
    uvicorn.run(
        make_app(int(sys.argv[2]) if len(sys.argv) > 2 else 8, float(sys.argv[3]) if len(sys.argv) > 3 else 0.0),
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
    )

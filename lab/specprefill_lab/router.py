"""A router in front of engine replicas, as users run one when they go direct: the bench's direct path with
several replicas.

Policies:
  round-robin  each request to the next replica (vLLM's router and most load balancers by default)
  prefix       prefix affinity, as SGLang's cache-aware router: a request goes to the replica whose recent
               prompts share the longest prefix with it (by characters), when that prefix is at least half the
               prompt (its ``cache_threshold``); otherwise to the replica with the fewest requests in flight
               (of those, the one chosen longest ago)

A replica that refuses the connection is skipped for the next one (as nginx's ``proxy_next_upstream error``);
one that fails after it took the request answers the client 502. Only what the bench needs: OpenAI's POST
endpoints passed through (streams as they come), ``/v1/models`` and ``/health`` from the first replica.
Run: ``python -m specprefill_lab.router --policy prefix --port P URL URL``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

POLICIES = ("round-robin", "prefix")
THRESHOLD = 0.5  # SGLang's default cache_threshold
MEMORY = 64  # recent prompts remembered per replica


def prompt_text(body: dict) -> str:
    """What a prefix-affinity router matches on: the prompt, or the messages' contents in order."""
    if "messages" in body:
        return "\x00".join(json.dumps(m.get("content"), sort_keys=True) for m in body["messages"])
    prompt = body.get("prompt") or body.get("input") or ""
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class Router:
    def __init__(self, urls: list[str], policy: str) -> None:
        assert policy in POLICIES, policy
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = policy
        self._next = itertools.cycle(range(len(urls)))
        self._recent = [collections.deque(maxlen=MEMORY) for _ in urls]
        self._in_flight = [0] * len(urls)
        self._chosen = [0] * len(urls)  # when each was last chosen (a count of requests)
        self._count = 0

    def choose(self, body: dict) -> int:
        if self.policy == "round-robin":
            return next(self._next)
        text = prompt_text(body)
        best, shared = None, 0
        for index, recent in enumerate(self._recent):
            for earlier in recent:
                n = len(os.path.commonprefix((earlier, text)))
                if n > shared:
                    best, shared = index, n
        if best is None or shared < THRESHOLD * len(text):
            best = min(range(len(self.urls)), key=lambda i: (self._in_flight[i], self._chosen[i]))
        self._recent[best].append(text)
        self._count += 1
        self._chosen[best] = self._count
        return best


class Proxy:
    """The router's HTTP side: each request relayed to the replica its policy chooses."""

    def __init__(self, urls: list[str], policy: str) -> None:
        self.router = Router(urls, policy)
        self._session: aiohttp.ClientSession | None = None

    def client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=3600))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: Request) -> Response:
        body = await request.json()
        router = self.router
        index = router.choose(body)
        for _ in range(len(router.urls)):
            try:
                response = await self.client().post(router.urls[index] + request.url.path, json=body)
                break
            except aiohttp.ClientConnectorError:
                index = (index + 1) % len(router.urls)
        else:
            return JSONResponse({"error": {"message": "no replica answers", "type": "upstream_error"}}, 502)
        router._in_flight[index] += 1
        return await self._relayed(response, index, bool(body.get("stream")))

    async def _relayed(self, response: aiohttp.ClientResponse, index: int, streamed: bool) -> Response:
        """The replica's answer, passed on; the replica's count of requests under way kept until its end."""
        in_flight = self.router._in_flight

        async def relay():
            try:
                async for piece in response.content.iter_any():
                    yield piece
            finally:
                response.release()
                in_flight[index] -= 1

        headers, media_type = {"x-replica": str(index)}, response.headers.get("content-type")
        if streamed:
            return StreamingResponse(relay(), status_code=response.status, headers=headers, media_type=media_type)
        try:
            return Response(await response.read(), status_code=response.status, headers=headers, media_type=media_type)
        finally:
            response.release()
            in_flight[index] -= 1

    async def first(self, request: Request) -> Response:
        async with self.client().get(self.router.urls[0] + request.url.path) as response:
            return Response(
                await response.read(), status_code=response.status, media_type=response.headers.get("content-type")
            )


def create_app(urls: list[str], policy: str) -> Starlette:
    proxy = Proxy(urls, policy)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await proxy.close()

    return Starlette(
        routes=[
            Route("/v1/{path:path}", proxy.forward, methods=["POST"]),
            Route("/v1/models", proxy.first),
            Route("/health", proxy.first),
        ],
        lifespan=lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--policy", choices=POLICIES, default="round-robin")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(args.urls, args.policy), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

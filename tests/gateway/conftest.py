from __future__ import annotations

import json

import pytest

from engine.server import create_app as create_engine_app
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.servers import serve


class RecordingApp:
    """Wraps an ASGI app and keeps every HTTP request's path, headers and JSON body (what the backend received)."""

    def __init__(self, app) -> None:
        self.app = app
        self.requests: list[dict] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.requests.append({"path": scope["path"], "headers": headers,
                              "body": json.loads(body) if body else None})

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def last(self, path: str) -> dict:
        return next(r for r in reversed(self.requests) if r["path"] == path)


@pytest.fixture(scope="session")
def engine_backend(model_pair):
    recorder = RecordingApp(create_engine_app(str(model_pair / "target"), device="cpu", served_name="target"))
    with serve(recorder) as url:
        yield url, recorder


def gateway_settings(model_pair, **overrides) -> GatewaySettings:
    values = dict(target_model=str(model_pair / "target"), draft_model=str(model_pair / "draft"),
                  min_prompt_tokens=64, device="cpu", served_model_name="tiny")
    values.update(overrides)
    return GatewaySettings(**values)


@pytest.fixture(scope="session")
def gateway_url(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], backend_kind="reference")
    with serve(create_app(settings)) as url:
        yield url

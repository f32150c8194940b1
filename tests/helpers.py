"""Helpers shared by test packages: a recording ASGI wrapper, gateway settings for the tiny model pair."""

from __future__ import annotations

import json

from gateway.settings import GatewaySettings
from specprefill.demo_models import synthetic_corpus

LONG_DOC = " ".join(synthetic_corpus(seed=3, n_sentences=60))


def chat_messages(question: str = "What is the third number?") -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": LONG_DOC + "\n\n" + question}]


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


def gateway_settings(model_pair, **overrides) -> GatewaySettings:
    values = dict(target_model=str(model_pair / "target"), draft_model=str(model_pair / "draft"),
                  min_prompt_tokens=64, device="cpu", served_model_name="tiny")
    values.update(overrides)
    return GatewaySettings(**values)

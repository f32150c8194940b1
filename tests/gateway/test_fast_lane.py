"""Chat completions and completions past FastAPI's layers (``gateway.entrypoints.fast_lane``): a request the lane
takes is served by the route's own handler, without FastAPI's app running; everything else goes through FastAPI
with its body replayed, and every error is the one FastAPI's route gives."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import GatewayApp, create_app
from tests.helpers import gateway_settings, serve

KEY = {"authorization": "Bearer k"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def keyed_url(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], api_key="k")
    with serve(create_app(settings)) as url:
        yield url


@pytest.fixture
def through_fastapi(monkeypatch):
    """The requests the gateway's FastAPI app ran (its path, not the lane's; the engine behind it is another app
    in this process)."""
    ran: list[str] = []
    original = FastAPI.__call__

    async def counted(self, scope, receive, send):
        if scope["type"] == "http" and isinstance(self, GatewayApp):
            ran.append(scope["path"])
        await original(self, scope, receive, send)

    monkeypatch.setattr(FastAPI, "__call__", counted)
    return ran


def test_valid_requests_take_the_lane_and_answer_as_the_route(keyed_url, through_fastapi):
    post = lambda path, body, **kw: httpx.post(f"{keyed_url}{path}", json=body, headers=KEY, timeout=60, **kw)  # noqa: E731
    chat = post("/v1/chat/completions", CHAT)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.headers["x-specprefill-status"] and chat.headers["x-request-id"]
    with httpx.stream("POST", f"{keyed_url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=KEY) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    text = post("/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 2})
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    missing = post("/v1/chat/completions", {**CHAT, "model": "nope"})  # raised by the handler, shaped here
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert through_fastapi == []
    assert httpx.get(f"{keyed_url}/v1/models", headers=KEY, timeout=60).status_code == 200
    assert through_fastapi == ["/v1/models"]


@pytest.mark.parametrize(
    ("content", "headers", "status", "param"),
    [
        (b'{"model": "tiny", "messages": [', {"content-type": "application/json"}, 400, None),  # not JSON
        (b'{"model": "tiny", "messages": "hi"}', {"content-type": "application/json"}, 400, "messages"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}', {}, 401, None),  # no key
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}',
         {"content-type": "text/plain"}, None, None),
    ],
)  # fmt: skip
def test_what_the_lane_does_not_take_goes_through_fastapi_with_its_body(
    keyed_url, through_fastapi, content, headers, status, param
):
    """Each answer is FastAPI's own: the same status and error as the route gave before the lane."""
    sent = {**KEY, **headers} if status != 401 else {"content-type": "application/json"}
    answer = httpx.post(f"{keyed_url}/v1/chat/completions", content=content, headers=sent, timeout=60)
    assert through_fastapi == ["/v1/chat/completions"]
    if status is None:  # FastAPI reads a body whatever its content type: the lane leaves that to it
        assert answer.status_code in (200, 400), answer.text
        return
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["message"] and error["param"] == param

"""A chat that goes whole whatever its tokens is sent before they are made (``--plan-after-send``): its tokens and
plan are made while the backend reads it, and nothing of its answer or its headers changes."""

from __future__ import annotations

import json
import time

import httpx
import pytest

import gateway.serving
from common.errors import InvalidRequestError
from gateway.app import create_app
from gateway.serving import GatewayServing
from tests.helpers import RecordingApp, engine_active, engine_app, eventually, gateway_settings, serve

SHORT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
MIN_TOKENS = 160  # the short chat's text has 118 bytes
LONG = {**SHORT, "messages": [{"role": "user", "content": "one two three four five six seven eight " * 12}]}
HEADERS = ("x-specprefill-status", "x-specprefill-reason", "x-specprefill-original-tokens", "x-specprefill-plan")


@pytest.fixture(scope="module")
def backend(model_pair):
    recorder = RecordingApp(engine_app(model_pair))
    with serve(recorder) as url:
        yield url, recorder


@pytest.fixture
def seen_at_prompt(monkeypatch, backend):
    """For each prompt the gateway tokenizes: whether the backend had its request by then (waited for up to
    ``wait`` seconds: the backend runs on another thread of this process). ``issued``: the chats sent so far."""
    recorder, seen, original = backend[1], [], GatewayServing.prompt
    state = {"wait": 2.0, "issued": 0}

    def prompt(self, request, text=None):
        deadline = time.monotonic() + state["wait"]
        while time.monotonic() < deadline and _chats(recorder) < state["issued"]:
            time.sleep(0.01)
        seen.append(_chats(recorder) >= state["issued"])
        return original(self, request, text)

    monkeypatch.setattr(GatewayServing, "prompt", prompt)
    return seen, state


def _chats(recorder) -> int:
    return sum(r["path"] == "/v1/chat/completions" for r in recorder.requests)


def _answers(url: str, body: dict, state: dict, headers: dict | None = None) -> tuple[dict, str, dict]:
    state["issued"] += 1
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert whole.status_code == 200, whole.text
    state["issued"] += 1
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    events = [json.loads(line[5:]) for line in lines if line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    return whole.json()["choices"][0], streamed, {h: whole.headers.get(h) for h in HEADERS}


def test_a_chat_that_goes_whole_reaches_the_backend_before_its_tokens_and_answers_the_same(
    model_pair, backend, seen_at_prompt, monkeypatch
):
    monkeypatch.setattr(gateway.serving, "OVERLAP_FROM_S", 0.0)  # whatever this engine's time to its first event
    seen, state = seen_at_prompt
    state["issued"] = _chats(backend[1])
    answers = {}
    for after in (True, False):
        state["wait"] = 2.0 if after else 0.3
        settings = gateway_settings(
            model_pair, backend_url=backend[0], plan_after_send=after, min_prompt_tokens=MIN_TOKENS
        )
        with serve(create_app(settings)) as url:
            _answers(url, SHORT, state)  # the gateway's connection to the backend opened (and kept alive)
            seen.clear()
            answers[after, "short"] = _answers(url, SHORT, state)  # fewer bytes than --min-prompt-tokens
            answers[after, "off"] = _answers(url, LONG, state, {"x-specprefill": "off"})
            assert seen == [after] * 4, seen
            seen.clear()
            answers[after, "long"] = _answers(url, LONG, state)  # compressed: planned before it is sent
            assert seen == [False, False], seen
    for case in ("short", "off", "long"):
        assert answers[True, case] == answers[False, case], case
    assert answers[True, "short"][2]["x-specprefill-reason"] == "short_prompt"
    assert answers[True, "off"][2]["x-specprefill-reason"] == "off"
    assert answers[True, "long"][2]["x-specprefill-status"] == "compressed"


def test_against_an_engine_that_answers_sooner_than_a_plan_is_made_the_plan_comes_first(
    model_pair, backend, seen_at_prompt, monkeypatch
):
    """Sent first, a request to an engine that answers at once is slower (the plan's work is not hidden, and
    costs more after the send): only an engine whose recent requests took ``OVERLAP_FROM_S`` gets them first."""
    monkeypatch.setattr(gateway.serving, "OVERLAP_FROM_S", 60.0)
    seen, state = seen_at_prompt
    state["issued"], state["wait"] = _chats(backend[1]), 0.3
    settings = gateway_settings(model_pair, backend_url=backend[0], min_prompt_tokens=MIN_TOKENS)
    with serve(create_app(settings)) as url:
        _answers(url, SHORT, state)
        seen.clear()
        _answers(url, SHORT, state)
    assert seen == [False, False], seen


def test_a_plan_that_fails_after_the_send_is_the_clients_error_and_ends_the_request_at_the_backend(
    model_pair, backend, monkeypatch
):
    def refused(self, request, text=None):
        raise InvalidRequestError("refused after the send", param="messages")

    monkeypatch.setattr(GatewayServing, "prompt", refused)
    monkeypatch.setattr(gateway.serving, "OVERLAP_FROM_S", 0.0)
    settings = gateway_settings(model_pair, backend_url=backend[0])
    with serve(create_app(settings)) as url:
        for stream in (False, True):
            body = {**SHORT, "max_tokens": 200, "stream": stream}
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert answer.status_code == 400 and "refused after the send" in answer.json()["error"]["message"]
    assert _sync_eventually(lambda: engine_active(backend[0]) == 0, within=5)


def _sync_eventually(predicate, within: float) -> bool:
    import asyncio

    return asyncio.run(eventually(predicate, within))

"""Backend kinds, faults and auth, each against real servers on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from common.process import free_port
from draft_worker import ScoringConfig
from gateway.app import create_app
from tests.helpers import LONG_DOC, disconnects_release_the_engine, gateway_settings, serve
from tests.helpers import chat_messages as _messages
from tests.helpers import openai_client as _client


def _body(**extra) -> dict:
    return {"model": "tiny", "messages": _messages(), "max_tokens": 4, "temperature": 0, **extra}


def test_tokens_kind_sends_kept_tokens_without_positions(model_pair, engine_backend):
    url, recorder = engine_backend
    with serve(create_app(gateway_settings(model_pair, backend_url=url, backend_kind="tokens"))) as gw:
        raw = _client(gw).chat.completions.with_raw_response.create(**_body(), extra_headers={"x-keep-rate": "0.3"})
        assert raw.headers["x-specprefill-status"] == "compressed" and raw.parse().choices[0].message.content
        sent = recorder.last("/v1/completions")["body"]
        assert len(sent["prompt"]) == int(raw.headers["x-specprefill-kept-tokens"])
        assert "position_ids" not in sent and "vllm_xargs" not in sent
        # the Responses API has no token-ID form: it goes whole to the backend's own endpoint
        raw = _client(gw).responses.with_raw_response.create(
            model="tiny", input=LONG_DOC, max_output_tokens=2, extra_headers={"x-keep-rate": "0.3"}
        )
        assert raw.headers["x-specprefill-reason"] == "unsupported_responses" and raw.parse().output_text is not None
        assert recorder.last("/v1/responses")["body"]["input"] == LONG_DOC


def test_vllm_kind_sends_the_clients_body_plus_the_swap(model_pair, engine_backend):
    url, recorder = engine_backend
    with (
        serve(create_app(gateway_settings(model_pair, backend_url=url, backend_kind="vllm"))) as gw,
        _client(gw) as client,
    ):
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=LONG_DOC, max_tokens=2, seed=3, extra_headers={"x-keep-rate": "0.3"}
        )
        assert raw.headers["x-specprefill-status"] == "compressed"
        sent = recorder.last("/v1/completions")["body"]
        assert sent["prompt"] == LONG_DOC and sent["seed"] == 3 and "position_ids" not in sent
        swap = sent["vllm_xargs"]
        assert len(swap["kept_token_ids"]) == len(swap["position_ids"]) == int(raw.headers["x-specprefill-kept-tokens"])
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        raw = client.chat.completions.with_raw_response.create(
            **_body(n=2, presence_penalty=0.5, tools=tools), extra_headers={"x-keep-rate": "0.3"}
        )
        assert raw.headers["x-specprefill-status"] == "compressed" and len(raw.parse().choices) == 2
        sent = recorder.last("/v1/chat/completions")["body"]
        assert sent["messages"] == _messages() and sent["tools"] == tools and sent["n"] == 2
        assert "kept_token_ids" in sent["vllm_xargs"]


def test_text_kind_sends_kept_text_to_chat_completions(model_pair, engine_backend):
    url, recorder = engine_backend
    with serve(create_app(gateway_settings(model_pair, backend_url=url, backend_kind="text"))) as gw:
        client = _client(gw)
        raw = client.chat.completions.with_raw_response.create(**_body(), extra_headers={"x-keep-rate": "0.2"})
        assert raw.headers["x-specprefill-status"] == "compressed" and raw.parse().choices[0].message.content
        sent = recorder.last("/v1/chat/completions")["body"]
        assert [m["role"] for m in sent["messages"]] == ["system", "user"]
        assert sent["messages"][0]["content"] == "Answer briefly."  # short message kept whole
        assert "…" in sent["messages"][1]["content"]
        assert len(sent["messages"][1]["content"]) < 0.6 * len(_messages()[1]["content"])
        assert sent["messages"][1]["content"].rstrip().endswith("third number?")  # the protected tail
        stream = client.completions.create(
            model="tiny", prompt=LONG_DOC, max_tokens=3, stream=True, extra_headers={"x-keep-rate": "0.2"}
        )
        chunks = [c for c in stream if c.choices]
        assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
        sent = recorder.last("/v1/completions")["body"]
        assert isinstance(sent["prompt"], str) and len(sent["prompt"]) < 0.5 * len(LONG_DOC)


class FailingDraft:
    config = ScoringConfig()
    score_params = config.score_params
    max_prompt_tokens = 10**6

    async def identity(self):
        return "failing"

    async def score(self, token_ids):
        raise RuntimeError("draft exploded")

    def reusable_prefix(self, token_ids):
        return 0

    async def ready(self):
        return False

    async def close(self):
        return None


def test_a_failing_draft_forwards_the_full_prompt(model_pair, engine_backend):
    url, recorder = engine_backend
    with serve(create_app(gateway_settings(model_pair, backend_url=url), draft=FailingDraft())) as gw:
        for _ in range(2):
            raw = _client(gw).chat.completions.with_raw_response.create(**_body())
            assert raw.headers["x-specprefill-status"] == "bypassed"
            assert raw.headers["x-specprefill-reason"] == "draft_error"
            assert raw.parse().choices[0].message.content is not None
        assert int(raw.headers["x-specprefill-kept-tokens"]) == int(raw.headers["x-specprefill-original-tokens"])
        assert httpx.get(f"{gw}/health").json()["status"] == "degraded"


def test_an_unreachable_backend_is_a_502(model_pair):
    settings = gateway_settings(model_pair, backend_url=f"http://127.0.0.1:{free_port()}", backend_model="m")
    with serve(create_app(settings)) as gw:
        with pytest.raises(openai.APIStatusError) as excinfo:
            _client(gw).chat.completions.create(**_body())
        assert excinfo.value.status_code == 502 and "unreachable" in excinfo.value.message


def _fake_backend() -> FastAPI:
    """A chat backend that never answers (max_tokens 99), dies mid-stream, or refuses with a 400."""
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        if body.get("max_tokens") == 99:  # never answers
            await asyncio.sleep(3600)
        if not body.get("stream"):
            return JSONResponse(
                {
                    "error": {
                        "message": "context too long for this backend",
                        "code": None,
                        "type": "invalid_request_error",
                        "param": "messages",
                    }
                },
                status_code=400,
            )

        async def dying():
            chunk = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": "Hel"},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0.05)
            raise RuntimeError("backend died mid-stream")

        return StreamingResponse(dying(), media_type="text/event-stream")

    return app


def test_backend_faults(model_pair):
    with serve(_fake_backend()) as backend_url:
        settings = gateway_settings(model_pair, backend_url=backend_url, backend_model="m", backend_read_timeout=1.0)
        with serve(create_app(settings)) as gw:
            client = _client(gw)
            # never answers: 504
            with pytest.raises(openai.APIStatusError) as excinfo:
                client.chat.completions.create(**{**_body(), "max_tokens": 99})
            assert excinfo.value.status_code == 504
            # dies mid-stream: the stream has begun, so one error event and [DONE]
            with httpx.stream(
                "POST", f"{gw}/v1/chat/completions", json={**_body(), "stream": True}, timeout=30
            ) as response:
                assert response.status_code == 200
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hel"
            error = json.loads(events[-2])["error"]
            assert set(error) == {"message", "type", "param", "code"} and "mid-stream" in error["message"]
            # a backend 4xx passes through with its message
            with pytest.raises(openai.BadRequestError, match="context too long"):
                client.chat.completions.create(**_body(), extra_headers={"x-specprefill": "off"})
            # and the gateway still serves
            assert httpx.get(f"{gw}/v1/models").status_code == 200


def test_api_key_is_required_and_not_forwarded(model_pair, engine_backend):
    url, recorder = engine_backend
    settings = gateway_settings(model_pair, backend_url=url, api_key="client-secret", backend_api_key="backend-secret")
    with serve(create_app(settings)) as gw:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            _client(gw, api_key="wrong").models.list()
        assert httpx.post(f"{gw}/v1/chat/completions", json=_body()).status_code == 401
        assert httpx.get(f"{gw}/health").status_code == 200
        _client(gw, api_key="client-secret").chat.completions.create(**_body())
        sent = recorder.requests[-1]["headers"]
        assert sent["authorization"] == "Bearer backend-secret"
        assert "client-secret" not in json.dumps(recorder.requests[-1])


async def test_client_disconnects_cancel_the_backend_request(gateway_url, engine_backend):
    body = {"model": "tiny", "messages": _messages(), "max_tokens": 2000, "temperature": 0.8, "ignore_eos": True}
    await disconnects_release_the_engine(
        f"{gateway_url}/v1/chat/completions", body, engine_backend[0], headers={"x-keep-rate": "0.3"}
    )


async def test_an_idle_backend_connection_is_not_reused_past_vllms_keep_alive():
    """vLLM closes a connection idle for 5 s; a request sent on it just then fails before it is read. The gateway
    sends a request after 4.3 s of quiet on a new connection, not on the one vLLM may be closing."""
    from gateway.engines.backends import KEEPALIVE_S, HTTPBackend

    ports = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        ports.append(request.client.port)
        return {"choices": [{"text": "ok", "index": 0, "finish_reason": "stop"}]}

    with serve(app) as url:
        backend = HTTPBackend(url, "vllm", model="m")
        try:
            await backend.completion({"model": "m", "prompt": "a"})
            await backend.completion({"model": "m", "prompt": "b"})  # at once: the same connection
            await asyncio.sleep(KEEPALIVE_S + 0.3)
            await backend.completion({"model": "m", "prompt": "c"})
        finally:
            await backend.close()
    assert KEEPALIVE_S < 5 and ports[0] == ports[1] != ports[2], ports


def test_each_kind_says_how_kept_tokens_travel():
    """A backend's kind is read in one place (``gateway.engines.kinds``): what it takes, and the body that carries
    it."""
    from gateway.engines.kinds import KINDS

    params = {"max_tokens": 1}
    bodies = {name: kind.token_body("m", [5, 6], [0, 9], params) for name, kind in KINDS.items()}
    assert bodies["reference"] == {
        "model": "m",
        "prompt": [5, 6],
        "max_tokens": 1,
        "vllm_xargs": {"position_ids": [0, 9]},
        "position_ids": [0, 9],
    }
    assert bodies["vllm"] == {"model": "m", "prompt": [5, 6], "max_tokens": 1, "vllm_xargs": {"position_ids": [0, 9]}}
    assert bodies["tokens"] == bodies["text"] == {"model": "m", "prompt": [5, 6], "max_tokens": 1}
    assert [k.name for k in KINDS.values() if k.takes_swap] == ["reference", "vllm"]
    assert [k.name for k in KINDS.values() if not k.reads_tokens] == ["text"]


def test_a_token_body_holds_lists_as_json_has_them():
    """A plan's tokens and positions are tuples; an in-process backend reads the body as it is, without a JSON
    round trip, and its swap check takes lists only (a tuple there sent every compressed prompt whole)."""
    from gateway.engines.kinds import KINDS

    for kind in KINDS.values():
        body = kind.token_body("m", (5, 6, 7), (0, 2), {"max_tokens": 1})
        assert type(body["prompt"]) is list
        for value in (body.get("vllm_xargs") or {}).values():
            assert type(value) is list
        assert type(body.get("position_ids", [])) is list

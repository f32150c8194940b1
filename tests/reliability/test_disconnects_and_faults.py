"""Client disconnects at each moment release all work; backend faults and shutdown are handled cleanly."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from common.models import load_causal_lm, load_tokenizer
from common.process import free_port
from draft_worker import DraftWorker
from engine.engine import ReferenceEngine
from engine.server import create_app as create_engine_app
from engine.serving import EngineServing
from gateway.app import create_app
from gateway.planning.draft import LocalDraft
from tests.helpers import RecordingApp, chat_messages, engine_active, eventually, gateway_settings, serve, start_command


class SlowDraft(LocalDraft):
    async def score(self, token_ids):
        await asyncio.sleep(2.0)
        return await super().score(token_ids)


@pytest.fixture(scope="module")
def slow_prefill_engine(model_pair):
    """The reference engine on a target whose prefill chunks take 0.25 s each (slow hardware, simulated)."""
    model = load_causal_lm(model_pair / "target", device="cpu")

    def slow(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            time.sleep(0.25)

    model.register_forward_pre_hook(slow, with_kwargs=True)
    engine = ReferenceEngine(model, load_tokenizer(model_pair / "target"), prefill_chunk=64)
    recorder = RecordingApp(create_engine_app(serving=EngineServing(engine, ["target"])))
    with serve(recorder) as url:
        yield url, recorder
    engine.close()


async def test_disconnect_during_the_draft_never_reaches_the_backend(model_pair, slow_prefill_engine):
    engine_url, recorder = slow_prefill_engine
    worker = DraftWorker.from_pretrained(model_pair / "draft", device="cpu")
    settings = gateway_settings(model_pair, backend_url=engine_url)
    with serve(create_app(settings, draft=SlowDraft(worker))) as gw:

        def sent() -> int:  # work sent to the engine (the gateway also reads its /metrics)
            return sum(r["path"].startswith("/v1/") for r in recorder.requests)

        before = sent()
        body = {"model": "tiny", "messages": chat_messages("draft?"), "max_tokens": 500, "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(
                client.post(f"{gw}/v1/chat/completions", json=body, headers={"x-keep-rate": "0.3"})
            )
            await asyncio.sleep(0.5)  # inside the 2 s draft
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(2.5)  # past the draft's end: nothing may be sent on
        assert sent() == before and engine_active(engine_url) == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_during_prefill_stops_the_engine_within_a_second(model_pair, slow_prefill_engine, stream):
    engine_url, _ = slow_prefill_engine
    settings = gateway_settings(model_pair, backend_url=engine_url)
    with serve(create_app(settings)) as gw:
        body = {"model": "tiny", "messages": chat_messages("prefill?"), "max_tokens": 500, "stream": stream}
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(
                client.post(f"{gw}/v1/chat/completions", json=body, headers={"x-specprefill": "off"})
            )  # the whole prompt: slow
            assert await eventually(lambda: engine_active(engine_url) == 1, within=5)
            await asyncio.sleep(0.3)  # inside the prefill (about 20 chunks of 0.25 s)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await eventually(lambda: engine_active(engine_url) == 0, within=1.0)


def _engine_process(model_pair, port: int) -> subprocess.Popen:
    return start_command(
        [
            "engine",
            "--model",
            str(model_pair / "target"),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--served-model-name",
            "target",
        ],
        f"http://127.0.0.1:{port}",
    )


def test_backend_killed_mid_stream_then_restarted(model_pair):
    port = free_port()
    engine = _engine_process(model_pair, port)
    settings = gateway_settings(model_pair, backend_url=f"http://127.0.0.1:{port}", backend_model="target")
    try:
        with serve(create_app(settings)) as gw:
            body = {
                "model": "tiny",
                "messages": chat_messages("kill?"),
                "max_tokens": 2000,
                "stream": True,
                "temperature": 0.8,
                "ignore_eos": True,
            }
            with httpx.stream("POST", f"{gw}/v1/chat/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            engine.send_signal(signal.SIGKILL)
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
            down = httpx.post(f"{gw}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}, timeout=30)
            assert down.status_code == 502 and down.json()["error"]["code"] == "backend_unreachable"
            engine.wait()
            engine = _engine_process(model_pair, port)  # the backend comes back on the same address
            again = httpx.post(f"{gw}/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}, timeout=60)
            assert again.status_code == 200  # the gateway recovered without a restart
    finally:
        engine.kill()
        engine.wait()


def test_a_signal_during_the_start_up_stops_the_gateway_at_once(model_pair):
    # a backend that takes the start-up probe's first request and never answers: the gateway is starting (on CPU
    # cores the probe of the real pair takes minutes), and a Ctrl-C or a SIGTERM then stopped it only once the
    # start-up had ended
    with socket.create_server(("127.0.0.1", 0)) as backend:
        backend_url = f"http://127.0.0.1:{backend.getsockname()[1]}"
        args = ["serve", "--port", str(free_port()), "--backend-url", backend_url, "--backend-kind", "vllm"]
        args += ["--target-model", str(model_pair / "target"), "--draft-model", str(model_pair / "draft")]
        for sig in (signal.SIGTERM, signal.SIGINT):
            with subprocess.Popen(
                [sys.executable, "-m", "specprefill", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            ) as gateway:
                backend.settimeout(120)
                connection, _ = backend.accept()  # the gateway's first request to the backend: it is starting
                gateway.send_signal(sig)
                try:
                    _, err = gateway.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    gateway.kill()
                    raise
                finally:
                    connection.close()
            assert gateway.returncode == 128 + sig, err.decode()[-2000:]
            assert b"stopping: a signal before the server was up" in err, err.decode()[-2000:]
            assert b"Traceback" not in err, err.decode()[-2000:]


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(model_pair):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = start_command(
        [
            "serve",
            "--port",
            str(port),
            "--target-model",
            str(model_pair / "target"),
            "--draft-model",
            str(model_pair / "draft"),
            "--device",
            "cpu",
            "--served-model-name",
            "tiny",
            "--drain-timeout",
            "20",
        ],
        url,
    )
    try:
        # long enough to be in flight for a while after SIGTERM (300 tokens took under 0.3 s on a fast machine,
        # so the gateway had drained and exited before the request it should refuse)
        body = {
            "model": "tiny",
            "messages": chat_messages("drain?"),
            "max_tokens": 2000,
            "stream": True,
            "temperature": 0.8,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            gateway.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "overloaded_error"
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and not any('"error"' in e for e in rest)  # the stream finished whole
        assert gateway.wait(timeout=30) == 0  # a clean drain exits 0 (not by the SIGTERM uvicorn raises again)
    finally:
        gateway.kill()
        gateway.wait()


def _stalling_backend():
    """A chat backend whose answers never end: a stream sends one chunk and stalls, a whole answer never comes."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    app.state.arrived = 0

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        app.state.arrived += 1
        if not body.get("stream"):
            await asyncio.sleep(3600)
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "m",
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None}
            ],
        }

        async def stalling():
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(3600)

        return StreamingResponse(stalling(), media_type="text/event-stream")

    return app


def test_a_drain_that_runs_out_of_time_ends_every_request_in_its_shape(model_pair):
    """Before: the non-streamed requests got a 500 with a non-JSON body, the streams were cut without an error
    event or [DONE] (uvicorn cancelled them)."""
    from concurrent.futures import ThreadPoolExecutor

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stalling = _stalling_backend()
    with serve(stalling) as backend:
        gateway = start_command(
            [
                "serve",
                "--port",
                str(port),
                "--target-model",
                str(model_pair / "target"),
                "--draft-model",
                str(model_pair / "draft"),
                "--device",
                "cpu",
                "--served-model-name",
                "tiny",
                "--backend-url",
                backend,
                "--backend-kind",
                "text",
                "--backend-model",
                "m",
                "--no-calibrate",
                "--no-warming",
                "--drain-timeout",
                "1",
            ],
            url,
        )
        try:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            messages = {**chat, "stream": True}

            def whole() -> httpx.Response:
                return httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)

            def streamed(path: str, body: dict) -> list[str]:
                with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
                    assert response.status_code == 200
                    return list(response.iter_lines())

            with ThreadPoolExecutor(3) as pool:
                answer = pool.submit(whole)
                chat_stream = pool.submit(streamed, "/v1/chat/completions", {**chat, "stream": True})
                messages_stream = pool.submit(streamed, "/v1/messages", messages)
                deadline = time.monotonic() + 60
                while stalling.state.arrived < 3 and time.monotonic() < deadline:  # all three at the backend
                    time.sleep(0.05)
                time.sleep(0.3)  # the streams' first chunks through
                gateway.send_signal(signal.SIGTERM)
                refused, chat_lines, messages_lines = answer.result(), chat_stream.result(), messages_stream.result()
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "overloaded_error"
            events = [line[6:] for line in chat_lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "overloaded_error"
            assert "event: error" in messages_lines
            error = json.loads(messages_lines[messages_lines.index("event: error") + 1][6:])
            assert error == {
                "type": "error",
                "error": {"type": "overloaded_error", "message": error["error"]["message"]},
                "request_id": error.get("request_id"),
            }
            assert re.fullmatch(r"[0-9a-f]{32}", error["request_id"])  # made by the gateway, as on every answer
            assert gateway.wait(timeout=30) != 0  # not a clean drain
        finally:
            gateway.kill()
            gateway.wait()

"""One request followed end to end: its ID on every answer and in every service's log line, and its trace, one span
tree per request, received by an OTLP/HTTP collector (a small server here that decodes the protobuf the exporter
sends with OpenTelemetry's own message classes), continued from the client and into the engine."""

from __future__ import annotations

import logging
import re
import threading

import httpx
import pytest
from fastapi import FastAPI, Request, Response
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from common.process import free_port
from common.tracing import Tracing
from gateway.app import create_app
from tests.helpers import LONG_DOC, RecordingApp, engine_app, gateway_settings, serve
from tests.helpers import chat_messages as _messages

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


class Collector:
    """An OTLP/HTTP trace receiver: every span it is sent, with its attributes as plain values."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.app = FastAPI()

        @self.app.post("/v1/traces")
        async def traces(request: Request) -> Response:
            message = ExportTraceServiceRequest.FromString(await request.body())
            with self.lock:
                for resource in message.resource_spans:
                    service = {a.key: _value(a.value) for a in resource.resource.attributes}["service.name"]
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            self.spans.append(
                                {
                                    "service": service,
                                    "name": span.name,
                                    "trace": span.trace_id.hex(),
                                    "id": span.span_id.hex(),
                                    "parent": span.parent_span_id.hex(),
                                    "kind": span.kind,
                                    "error": span.status.code == 2,
                                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                                }
                            )
            return Response(ExportTraceServiceRequest().SerializeToString(), media_type="application/x-protobuf")


def _value(value):
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture
def collector():
    receiver = Collector()
    with serve(receiver.app) as url:
        yield receiver, url


def _tree(spans: list[dict], root: dict) -> list[dict]:
    """The root's descendants, in the order received."""
    ids, grown = {root["id"]}, True
    while grown:  # a child ends, and is sent, before its parent
        grown = False
        for span in spans:
            if span["parent"] in ids and span["id"] not in ids:
                ids.add(span["id"])
                grown = True
    return [span for span in spans if span["id"] in ids and span is not root]


def test_the_client_s_request_id_is_echoed_on_every_answer_and_sent_on(gateway_url, engine_backend):
    recorder = engine_backend[1]
    ok = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": "tiny", "messages": _messages(), "max_tokens": 2},
        headers={"x-request-id": "client-id-42", "x-keep-rate": "0.3"},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "client-id-42"
    assert ok.headers["x-specprefill-status"] == "compressed"
    assert recorder.last("/v1/chat/completions")["headers"]["x-request-id"] == "client-id-42"  # as vLLM takes it
    made = httpx.post(f"{gateway_url}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=30)
    assert made.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    for insane in ("has spaces in it", "x" * 129, "ünï"):
        answer = httpx.get(f"{gateway_url}/v1/models", headers={"x-request-id": insane.encode()}, timeout=30)
        assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"]), insane
    with httpx.stream(
        "POST",
        f"{gateway_url}/v1/chat/completions",
        json={"model": "tiny", "messages": _messages(), "max_tokens": 2, "stream": True},
        headers={"x-request-id": "stream-7"},
        timeout=60,
    ) as stream:
        assert stream.headers["x-request-id"] == "stream-7" and "[DONE]" in stream.read().decode()
    refused = httpx.post(  # Anthropic's error shape has room for it
        f"{gateway_url}/v1/messages",
        json={"model": "nope", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-request-id": "anthropic-1"},
        timeout=30,
    )
    assert refused.status_code == 404 and refused.json()["request_id"] == "anthropic-1"
    assert refused.headers["x-request-id"] == "anthropic-1"
    too_big = httpx.post(  # refused by the guard, before the app
        f"{gateway_url}/v1/chat/completions", content=b"x" * (17 << 20), headers={"x-request-id": "big-1"}, timeout=60
    )
    assert too_big.status_code == 413 and too_big.headers["x-request-id"] == "big-1"


def test_each_service_logs_one_line_per_request_with_the_same_id(model_pair, caplog):
    """The gateway's line, the remote draft worker's and the engine's, for one request: the same ID."""
    from draft_worker.service import create_app as draft_app
    from draft_worker.settings import DraftWorkerSettings

    caplog.set_level(logging.INFO, logger="specprefill.request")
    worker_settings = DraftWorkerSettings(model=str(model_pair / "draft"), device="cpu")
    with (
        serve(engine_app(model_pair)) as engine,
        serve(draft_app(worker_settings)) as worker,
        serve(
            create_app(gateway_settings(model_pair, backend_url=engine, draft_worker_url=[worker], draft_model=None))
        ) as gw,
    ):
        answer = httpx.post(
            f"{gw}/v1/chat/completions",
            json={"model": "tiny", "messages": _messages(), "max_tokens": 2},
            headers={"x-request-id": "followed-1", "x-keep-rate": "0.2"},
            timeout=120,
        )
    assert answer.status_code == 200 and answer.headers["x-specprefill-status"] == "compressed"
    lines = [r.getMessage() for r in caplog.records if "id=followed-1 " in r.getMessage()]
    paths = [re.search(r"path=(\S+)", line).group(1) for line in lines]
    # the gateway's, the engine's (the client's body with the swap, at its own chat endpoint) and the worker's
    assert paths.count("/v1/chat/completions") == 2 and "/v1/score" in paths, lines
    gateway_line = next(line for line in lines if "compression=" in line)  # the engine's has no plan
    for field in (
        "status=200",
        "model=tiny",
        "operation=chat",
        "compression=compressed",
        "plan=fresh",
        "input_tokens=",
    ):
        assert field in gateway_line, gateway_line
    assert LONG_DOC[:40] not in " ".join(lines)  # no prompt text in the log


def test_a_request_log_line_can_be_json(model_pair, engine_backend, caplog):
    import json

    from common.telemetry import RequestTelemetry

    caplog.set_level(logging.INFO, logger="specprefill.request")
    app = RequestTelemetry(create_app(gateway_settings(model_pair, backend_url=engine_backend[0])), log_json=True)
    with serve(app) as url:
        httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": LONG_DOC, "max_tokens": 2},
            headers={"x-request-id": "as-json"},
            timeout=60,
        )
    records = [json.loads(r.getMessage()) for r in caplog.records if '"id": "as-json"' in r.getMessage()]
    assert records and records[0]["operation"] == "text_completion" and records[0]["status"] == 200


def _traced_requests(model_pair, dead: str, gateway_tracing: Tracing, engine_tracing: Tracing) -> None:
    with serve(RecordingApp(engine_app(model_pair)), writer=engine_tracing.writer) as engine:
        settings = gateway_settings(model_pair, backend_url=[dead, engine], backend_model="target", planner="cost")
        with serve(create_app(settings), writer=gateway_tracing.writer) as gateway:
            chat = httpx.post(
                f"{gateway}/v1/chat/completions",
                json={"model": "tiny", "messages": _messages(), "max_tokens": 2},
                headers={"traceparent": TRACEPARENT, "x-keep-rate": "0.3", "x-request-id": "traced-chat"},
                timeout=120,
            )
            assert chat.status_code == 200 and chat.headers["x-specprefill-status"] == "compressed", chat.text
            with httpx.stream(
                "POST",
                f"{gateway}/v1/messages",
                json={"model": "tiny", "max_tokens": 2, "stream": True, "messages": _messages()[1:]},
                headers={"x-request-id": "traced-messages"},
                timeout=120,
            ) as stream:
                stream.read()
            refused = httpx.post(
                f"{gateway}/v1/chat/completions",
                json={"model": "tiny", "messages": _messages()},
                headers={"x-keep-rate": "2", "x-request-id": "traced-refusal"},
                timeout=30,
            )
            assert refused.status_code == 400


def test_one_span_tree_per_request_reaches_the_collector(model_pair, collector):
    receiver, url = collector
    gateway_tracing, engine_tracing = Tracing("specprefill-gateway", url), Tracing("specprefill-engine", url)
    dead = f"http://127.0.0.1:{free_port()}"  # a replica that is gone: the request fails over to the live one
    try:
        _traced_requests(model_pair, dead, gateway_tracing, engine_tracing)
    finally:
        gateway_tracing.shutdown()  # every span sent on
        engine_tracing.shutdown()
    spans = receiver.spans
    servers = {
        s["attributes"]["specprefill.request_id"]: s
        for s in spans
        if s["kind"] == 2 and s["service"] == "specprefill-gateway"
    }
    assert set(servers) >= {"traced-chat", "traced-messages", "traced-refusal"}

    root = servers["traced-chat"]
    assert root["trace"] == CLIENT_TRACE and root["parent"] == "00f067aa0ba902b7"  # the client's trace, continued
    attributes = root["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.usage.input_tokens"] > 100 and attributes["gen_ai.usage.output_tokens"] >= 1
    assert "gen_ai.usage.cache_read.input_tokens" in attributes
    assert attributes["specprefill.compression"] == "compressed" and attributes["specprefill.plan"] in (
        "fresh",
        "extend",
    )
    assert attributes["specprefill.kept_tokens"] < attributes["specprefill.original_tokens"]
    assert attributes["specprefill.keep_rate"] == pytest.approx(0.3) and "specprefill.draft_ms" in attributes
    assert "specprefill.backend_ms" in attributes and "specprefill.predicted_ms" in attributes
    assert attributes["http.response.status_code"] == 200
    below = _tree(spans, root)
    names = [s["name"] for s in below]
    assert {"specprefill.plan", "specprefill.draft", "specprefill.backend"} <= set(names), names
    backends = [s for s in below if s["name"] == "specprefill.backend"]
    # the replica that is gone: a backend span with an error, then the one that answered
    assert [s["error"] for s in backends][-1] is False and any(s["error"] for s in backends), backends
    answered = backends[-1]
    into_engine = [s for s in spans if s["service"] == "specprefill-engine" and s["parent"] == answered["id"]]
    assert into_engine and into_engine[0]["trace"] == CLIENT_TRACE  # the engine's span, under the backend call

    streamed = servers["traced-messages"]
    assert streamed["attributes"]["gen_ai.usage.output_tokens"] >= 1 and streamed["trace"] != CLIENT_TRACE
    refusal = servers["traced-refusal"]
    assert refusal["attributes"]["http.response.status_code"] == 400 and not _tree(spans, refusal)


def test_tracing_is_off_unless_configured(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert not Tracing("x").on
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert Tracing("x").on
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not Tracing("x", "http://127.0.0.1:1").on


@pytest.mark.parametrize("sampler", ["always_on", "always_off"])
def test_spans_are_made_after_the_answer_as_the_sampler_says(monkeypatch, sampler):
    """The spans written while the request runs become the SDK's finished spans at ``finish`` (after the answer),
    one per span, children under their parents; a request not sampled still sends its context on, marked so,
    and makes none."""
    from common.tracing import enter, inject_context, leave, span

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
    tracing = Tracing("x", "http://127.0.0.1:1")
    made: list = []
    monkeypatch.setattr(tracing.writer.processor, "on_end", made.append)
    trace = tracing.writer.begin("POST /v1/chat/completions", {}, {"specprefill.request_id": "r"})
    token = enter(trace)
    headers: dict[str, str] = {}
    with span("specprefill.plan") as plan, span("specprefill.backend", replica=0) as backend:
        inject_context(headers)
    leave(token)
    assert made == []  # nothing made while the request runs
    trace.finish()
    tracing.shutdown()
    server = trace.server.context
    flags = "01" if sampler == "always_on" else "00"
    assert headers["traceparent"] == f"00-{server.trace_id:032x}-{backend.context.span_id:016x}-{flags}"
    assert backend.parent == plan.context and plan.parent == server
    if sampler == "always_off":
        assert made == []
        return
    assert [s.name for s in made] == ["POST /v1/chat/completions", "specprefill.plan", "specprefill.backend"]
    assert {s.context.trace_id for s in made} == {server.trace_id} and made[2].parent.span_id == plan.context.span_id
    assert all(s.start_time <= s.end_time for s in made) and made[2].attributes["replica"] == 0

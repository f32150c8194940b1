"""A live gateway in front of a live reference engine, driven by the real OpenAI SDK."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from common.selection import AutoKeepRate
from gateway.app import create_app
from gateway.settings import GatewaySettings
from specprefill_lab.bench import parse_server_timing
from tests.helpers import LONG_DOC, gateway_settings, serve
from tests.helpers import chat_messages as _messages
from tests.helpers import openai_client as _client


def test_models_list(gateway_url):
    assert [m.id for m in _client(gateway_url).models.list().data] == ["tiny"]


def test_chat_compressed_with_headers(gateway_url):
    def ask():
        return _client(gateway_url).chat.completions.with_raw_response.create(
            model="tiny",
            messages=_messages("Which header?"),
            max_tokens=8,
            temperature=0,
            extra_headers={"x-keep-rate": "0.3"},
        )

    raw = ask()
    completion = raw.parse()
    assert raw.headers["x-specprefill-status"] == "compressed"
    original, kept = int(raw.headers["x-specprefill-original-tokens"]), int(raw.headers["x-specprefill-kept-tokens"])
    assert kept < 0.5 * original
    assert raw.headers["x-specprefill-keep-rate"] == "0.3"
    assert raw.headers["x-specprefill-cache"] == "miss"  # a prompt no other test sends
    assert float(raw.headers["x-specprefill-draft-ms"]) > 0
    assert ask().headers["x-specprefill-cache"] == "hit"
    assert completion.object == "chat.completion" and completion.choices[0].message.role == "assistant"
    assert completion.usage.prompt_tokens == original
    assert completion.usage.model_extra["specprefill"] == {
        "original_prompt_tokens": original,
        "kept_prompt_tokens": kept,
    }


def test_chat_stream_with_usage(gateway_url):
    stream = _client(gateway_url).chat.completions.create(
        model="tiny",
        messages=_messages(),
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-keep-rate": "0.2"},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = _client(gateway_url).chat.completions.create(
        model="tiny", messages=_messages(), max_tokens=6, temperature=0, extra_headers={"x-keep-rate": "0.2"}
    )
    assert plain.choices[0].message.content == text


def test_completions_streamed_and_not(gateway_url):
    client = _client(gateway_url)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=LONG_DOC, max_tokens=5, temperature=0, extra_body={"specprefill": {"keep_rate": 0.25}}
    )
    assert raw.headers["x-specprefill-status"] == "compressed"
    assert raw.headers["x-specprefill-keep-rate"] == "0.25"
    text = raw.parse().choices[0].text
    streamed = client.completions.create(
        model="tiny",
        prompt=LONG_DOC,
        max_tokens=5,
        temperature=0,
        stream=True,
        extra_body={"specprefill": {"keep_rate": 0.25}},
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_header_beats_body_extension(gateway_url):
    raw = _client(gateway_url).completions.with_raw_response.create(
        model="tiny",
        prompt=LONG_DOC,
        max_tokens=1,
        extra_headers={"x-keep-rate": "0.5"},
        extra_body={"specprefill": {"keep_rate": 0.1}},
    )
    assert raw.headers["x-specprefill-keep-rate"] == "0.5"


def test_keep_rate_one_equals_off_token_for_token(gateway_url):
    client = _client(gateway_url)
    outputs = {}
    for name, headers in {"one": {"x-keep-rate": "1"}, "off": {"x-specprefill": "off"}}.items():
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=_messages(), max_tokens=24, temperature=0, logprobs=True, extra_headers=headers
        )
        outputs[name] = raw.parse()
        assert raw.headers["x-specprefill-status"] == "bypassed"
        assert raw.headers["x-specprefill-reason"] == {"one": "keep_rate_one", "off": "off"}[name]
    tokens = {k: [t.token for t in v.choices[0].logprobs.content] for k, v in outputs.items()}
    assert tokens["one"] == tokens["off"] and len(tokens["one"]) > 0
    assert outputs["one"].choices[0].message.content == outputs["off"].choices[0].message.content


def test_engine_receives_what_compress_reports(gateway_url, engine_backend):
    _, recorder = engine_backend
    body = {"model": "tiny", "messages": _messages("Which word comes first?"), "max_tokens": 2, "temperature": 0}
    headers = {"x-keep-rate": "0.3"}
    report = httpx.post(f"{gateway_url}/v1/specprefill/compress", json=body, headers=headers, timeout=60).json()
    assert report["status"] == "compressed" and report["kept_tokens"] == len(report["token_ids"])
    assert report["kept_tokens"] < report["original_tokens"]
    assert report["position_ids"][-1] == report["original_tokens"] - 1  # the last prompt token always goes
    response = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200
    sent = recorder.last("/v1/chat/completions")["body"]  # the client's own body, plus the swap
    assert sent["messages"] == body["messages"]
    assert sent["vllm_xargs"] == {"kept_token_ids": report["token_ids"], "position_ids": report["position_ids"]}


def test_short_prompts_bypass(gateway_url):
    raw = _client(gateway_url).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-specprefill-status"] == "bypassed"
    assert raw.headers["x-specprefill-reason"] == "short_prompt"


def test_features_the_engine_renders_itself_are_compressed(gateway_url):
    """n, penalties and logit_bias stay the engine's: the swap changes only the prompt it reads."""
    with _client(gateway_url) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=_messages(), max_tokens=2, n=2, presence_penalty=0.5, logit_bias={"7": 5}
        )
        assert raw.headers["x-specprefill-status"] == "compressed" and len(raw.parse().choices) == 2
    response = httpx.post(
        f"{gateway_url}/v1/specprefill/compress", timeout=60, json={"model": "tiny", "messages": _messages(), "n": 2}
    )
    assert response.json()["status"] == "compressed"


def test_content_the_draft_cannot_read_goes_whole(gateway_url):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    # forwarded whole: the answer is the engine's own (this one reads text only), not a gateway 400
    with _client(gateway_url) as client, pytest.raises(openai.BadRequestError, match="reads text content parts only"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)


def test_sdk_errors_carry_the_server_message(gateway_url):
    client = _client(gateway_url)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="tiny", messages=_messages(), extra_headers={"x-keep-rate": "2"})
    assert "x-keep-rate must be a decimal in (0, 1]" in str(excinfo.value)
    assert excinfo.value.body["param"] == "x-keep-rate"
    with pytest.raises(openai.NotFoundError, match="does not exist") as missing:
        client.chat.completions.create(model="gpt-4o", messages=_messages())
    # what it serves (the agents' default names too) and how to serve this name as well
    assert "this gateway serves 'tiny'" in str(missing.value) and "'gpt-6.2-sol'" in str(missing.value)
    assert "--model-alias gpt-4o" in str(missing.value)
    for agents_default in ("claude-opus-5-5", "gpt-6.2-sol"):
        client.chat.completions.create(model=agents_default, messages=_messages(), max_tokens=1)


BAD_KEEP_RATES = ["", "abc", "nan", "NaN", "inf", "-inf", "0", "0.0", "-0.5", "1.5", "1e400", "0x1"]


@pytest.mark.parametrize("value", BAD_KEEP_RATES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/specprefill/compress"])
def test_bad_keep_rate_header(gateway_url, value, path):
    body = {"model": "tiny", "messages": _messages()} if "chat" in path else {"model": "tiny", "prompt": LONG_DOC}
    response = httpx.post(f"{gateway_url}{path}", json=body, headers={"x-keep-rate": value}, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-keep-rate"


BAD_BODIES = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", json.dumps({"model": "tiny"}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "model"),
    ("/v1/chat/completions", json.dumps({"model": "tiny", "messages": []}).encode(), 400, "messages"),
    (
        "/v1/chat/completions",
        json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
        404,
        "model",
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            }
        ).encode(),
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 5}).encode(),
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "specprefill": {"keep_rate": 0}}
        ).encode(),
        400,
        "specprefill.keep_rate",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
        400,
        "max_tokens",
    ),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": [1, 10**7]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": ["a", "b"]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
]


@pytest.mark.parametrize("path,content,status,param", BAD_BODIES)
def test_bad_bodies_get_openai_errors_and_the_gateway_keeps_serving(gateway_url, path, content, status, param):
    response = httpx.post(
        f"{gateway_url}{path}", content=content, timeout=60, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    )
    assert ok.status_code == 200


def test_bad_mode_header(gateway_url):
    response = httpx.post(
        f"{gateway_url}/v1/completions",
        json={"model": "tiny", "prompt": "x"},
        headers={"x-specprefill": "maybe"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-specprefill"


def test_health_and_metrics(gateway_url):
    assert httpx.get(f"{gateway_url}/health").json() == {
        "status": "ok",
        "draft": {"ready": True, "tokenizer": "shared"},
        "backend": {"ready": True, "kind": "reference"},
    }
    client = _client(gateway_url)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    client.chat.completions.create(
        model="tiny", messages=_messages("metrics?"), max_tokens=1, extra_headers={"x-keep-rate": "0.3"}
    )
    text = httpx.get(f"{gateway_url}/metrics").text
    for name in (
        "specprefill_requests_total",
        "specprefill_ttft_seconds_bucket",
        "specprefill_draft_seconds",
        "specprefill_original_prompt_tokens",
        "specprefill_kept_prompt_tokens",
        "specprefill_keep_rate",
    ):
        assert name in text, name
    assert 'specprefill_requests_total{endpoint="chat",reason="short_prompt",status="bypassed"}' in text
    assert 'specprefill_requests_total{endpoint="chat",reason="",status="compressed"}' in text


def test_server_timing_breaks_the_request_down(gateway_url):
    raw = _client(gateway_url).chat.completions.with_raw_response.create(
        model="tiny", messages=_messages("timing?"), max_tokens=2, stream=True, extra_headers={"x-keep-rate": "0.3"}
    )
    list(raw.parse())
    parts = parse_server_timing(raw.headers["server-timing"])
    assert set(parts) == {"tokenize", "draft", "select", "backend", "predicted", "wait", "background"}
    assert all(v >= 0 for v in parts.values()) and parts["backend"] > 0
    assert parts["draft"] == float(raw.headers["x-specprefill-draft-ms"])
    assert 'plan;desc="fresh"' in raw.headers["server-timing"] and raw.headers["x-specprefill-plan"] == "fresh"


def test_a_new_api_surface_is_one_module_and_one_registration(model_pair, engine_backend, monkeypatch):
    """``tests/gateway/toy_surface.py`` is a whole API surface: its router, its serving object, the key check.
    Registering it is one line; the surfaces already there keep answering."""
    import gateway.app
    from gateway.app import create_app
    from tests.gateway import toy_surface
    from tests.helpers import gateway_settings, serve

    monkeypatch.setattr(gateway.app, "SURFACES", [*gateway.app.SURFACES, toy_surface])
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], api_key="k")
    with serve(create_app(settings)) as url:
        key = {"authorization": "Bearer k"}
        assert httpx.post(f"{url}/v1/toy/count", json={"text": "hello world"}, timeout=60).status_code == 401
        counted = httpx.post(f"{url}/v1/toy/count", json={"text": "hello world"}, headers=key, timeout=60)
        assert counted.status_code == 200 and counted.json()["tokens"] > 0
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=key, timeout=60).status_code == 200


# --- max_tokens past the room the prompt leaves (the small pair's target: 4,096 positions) ---


def _room(gateway_url: str, messages: list[dict]) -> int:
    answer = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 1},
        headers={"x-specprefill": "off"},
        timeout=60,
    ).json()
    return 4096 - answer["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**12}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**12},
            "max_completion_tokens",
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30, "stream": True}, "max_tokens"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 10**12}, "max_output_tokens"),
    ],
)
def test_max_tokens_that_cannot_fit_is_a_400_at_once_naming_the_field(gateway_url, path, body, field):
    start = time.perf_counter()
    response = httpx.post(f"{gateway_url}{path}", json={"model": "tiny", **body}, timeout=60)
    elapsed = time.perf_counter() - start
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"'{field}' is too large" in error["message"], error
    assert "maximum context length is 4096 tokens" in error["message"]
    assert elapsed < 5  # not run toward the context's end (a fault run's waited 60 s); 100 ms here, unloaded


@pytest.mark.parametrize("keep", ["1", "0.3"], ids=["whole", "compressed"])
def test_max_tokens_one_past_the_room_is_a_400_and_the_room_itself_is_served(gateway_url, keep):
    """The room counts the whole prompt's positions, compressed or not: generation continues after the last."""
    messages = _messages()
    room = _room(gateway_url, messages)
    headers = {"x-keep-rate": keep}
    over = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": room + 1},
        headers=headers,
        timeout=60,
    )
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens", over.text
    assert f"ask for at most {room}" in over.json()["error"]["message"]
    fits = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": room, "stop": ["a", "e", "i", "o"]},
        headers=headers,
        timeout=300,
    )
    assert fits.status_code == 200, fits.text
    assert fits.headers["x-specprefill-status"] == ("compressed" if keep != "1" else "bypassed")


def test_a_messages_request_past_the_room_is_lowered_to_it(gateway_url, engine_backend):
    """Claude Code asks for 32,000 tokens or more whatever the model: Messages lowers it, as vLLM does there."""
    response = httpx.post(
        f"{gateway_url}/v1/messages",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10**12,
            "stop_sequences": ["a", "e", "i", "o"],
        },
        headers={"x-specprefill": "off"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    sent = engine_backend[1].last("/v1/messages")["body"]
    assert 4000 < sent["max_tokens"] < 4096


# --- x-keep-rate: auto ---


def test_an_auto_keep_rate_is_chosen_from_the_scores_and_reported(gateway_url):
    body = {"model": "tiny", "messages": _messages(), "max_tokens": 1}
    auto = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, headers={"x-keep-rate": "auto"}, timeout=60)
    assert auto.status_code == 200 and auto.headers["x-specprefill-status"] == "compressed", auto.text
    rate = float(auto.headers["x-specprefill-keep-rate"])
    assert 0.05 <= rate <= 0.3  # the server's floor and ceiling
    wider = {**body, "specprefill": {"keep_rate": "auto", "auto_target": 0.99, "auto_ceiling": 1.0}}
    more = httpx.post(f"{gateway_url}/v1/chat/completions", json=wider, timeout=60)
    assert float(more.headers["x-specprefill-keep-rate"]) > rate  # nearly all the mass needs more chunks
    short = {**body, "messages": [{"role": "user", "content": "hi"}]}
    whole = httpx.post(f"{gateway_url}/v1/chat/completions", json=short, headers={"x-keep-rate": "auto"}, timeout=60)
    assert whole.status_code == 200 and whole.headers["x-specprefill-reason"] == "short_prompt"  # not an error
    metrics = httpx.get(f"{gateway_url}/metrics", timeout=30).text
    assert "specprefill_keep_rate_bucket" in metrics


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"keep_rate": "auto", "auto_target": 2}, "specprefill.auto_target"),
        ({"keep_rate": "auto", "auto_floor": 0}, "specprefill.auto_floor"),
        ({"keep_rate": "auto", "auto_floor": 0.5, "auto_ceiling": 0.2}, "specprefill.auto_floor"),
        ({"keep_rate": "automatic"}, "specprefill.keep_rate"),
    ],
)
def test_a_malformed_auto_rule_is_a_400_naming_the_setting(gateway_url, options, param):
    body = {"model": "tiny", "messages": _messages(), "max_tokens": 1, "specprefill": options}
    response = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_the_server_default_is_auto_and_a_fixed_rate_one_flag_away(gateway_url):
    assert GatewaySettings(target_model="t").keep_rate == "auto"  # measured on the real pair: docs/results/quality.md
    assert GatewaySettings(target_model="t").default_keep_rate == AutoKeepRate()
    assert GatewaySettings(target_model="t", keep_rate="0.3").default_keep_rate == 0.3
    body = {"model": "tiny", "messages": _messages("Which default?"), "max_tokens": 1}
    default = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=60)
    asked = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, headers={"x-keep-rate": "auto"}, timeout=60)
    fixed = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, headers={"x-keep-rate": "0.3"}, timeout=60)
    assert default.headers["x-specprefill-status"] == "compressed", default.text
    assert default.headers["x-specprefill-keep-rate"] == asked.headers["x-specprefill-keep-rate"]
    assert default.headers["x-specprefill-kept-tokens"] == asked.headers["x-specprefill-kept-tokens"]
    assert fixed.headers["x-specprefill-keep-rate"] == "0.3"


def test_the_server_default_auto_rule_takes_its_settings(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], keep_rate="auto", auto_keep_target=0.3)
    assert GatewaySettings(target_model="t", keep_rate="AUTO").keep_rate == "auto"
    with pytest.raises(ValueError, match="above --auto-keep-ceiling"):
        GatewaySettings(target_model="t", auto_keep_floor=0.5, auto_keep_ceiling=0.4)
    with serve(create_app(settings)) as url:
        body = {"model": "tiny", "messages": _messages(), "max_tokens": 1}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert answer.headers["x-specprefill-status"] == "compressed"
    assert 0.05 <= float(answer.headers["x-specprefill-keep-rate"]) <= 0.3

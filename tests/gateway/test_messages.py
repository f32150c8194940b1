"""Anthropic's Messages API through the gateway, with the real ``anthropic`` SDK, against the reference engine:
compressed like chat (sync, async, streamed, with tools), the kept tokens read at their positions as the
equivalent chat reads them, Anthropic's error shape for every bad input, token counts, a swap that does not
match, and the backend kinds without the swap."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
import torch

from common.messages import chat_to_message, message_events
from common.models import load_causal_lm, load_tokenizer
from gateway.app import create_app
from tests.helpers import (
    LONG_DOC,
    OPEN_CLIENTS,
    gateway_settings,
    openai_client,
    reference_logits,
    serve,
    target_with_another_template,
)

KEEP = {"x-keep-rate": "0.3"}
GREEDY = {"temperature": 0}  # the SDK takes sampling fields in the body only
SYSTEM = "You answer questions about the text. Be brief."
TOOLS = [
    {
        "name": "lookup_number",
        "description": "Find a number in the text",
        "input_schema": {"type": "object", "properties": {"index": {"type": "integer"}}, "required": ["index"]},
    }
]


def _client(url: str, **kwargs) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)
    OPEN_CLIENTS.append(client)  # closed after the test: no socket left to the garbage collector
    return client


def _transcript(steps: int = 2) -> list[dict]:
    """An agent's transcript: the document, then tool calls and their results."""
    messages: list[dict] = [{"role": "user", "content": LONG_DOC + "\n\nWhat is the third number?"}]
    for step in range(steps):
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": f"toolu_{step}", "name": "lookup_number", "input": {"index": step}},
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_{step}",
                        "content": [{"type": "text", "text": f"number {step}: {LONG_DOC[:200]}"}],
                    }
                ],
            }
        )
    return messages


def test_the_anthropic_sdk_sync_streamed_and_async(gateway_url, engine_backend):
    _, recorder = engine_backend
    client = _client(gateway_url)
    messages = [{"role": "user", "content": LONG_DOC + "\n\nWhat is the third number?"}]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    raw = client.messages.with_raw_response.create(
        model="tiny", system=system, messages=messages, max_tokens=4, extra_body=GREEDY, extra_headers=KEEP
    )
    assert raw.headers["x-specprefill-status"] == "compressed" and raw.headers["x-specprefill-plan"] == "fresh"
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.content[0].type == "text" and message.stop_reason in ("end_turn", "max_tokens")
    original = int(raw.headers["x-specprefill-original-tokens"])
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == original
    sent = recorder.last("/v1/messages")["body"]
    assert sent["system"] == system and sent["messages"] == messages  # the client's own body, plus the swap
    assert len(sent["vllm_xargs"]["kept_token_ids"]) == int(raw.headers["x-specprefill-kept-tokens"])

    with client.messages.with_streaming_response.create(
        model="tiny", system=SYSTEM, messages=messages, max_tokens=4, extra_body=GREEDY, stream=True, extra_headers=KEEP
    ) as streamed:
        assert streamed.headers["x-specprefill-status"] == "compressed"
        events = list(streamed.parse())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_stop" in kinds
    body = {"model": "tiny", "system": SYSTEM, "messages": messages, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/messages", json=body, headers=KEEP, timeout=60) as response:
        names = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"  # the SDK skips pings
    assert names.count("ping") == 1  # the engine's own ping, right after the gateway's, is not repeated
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == message.content[0].text  # greedy: the same answer, streamed
    final = events[-2]
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == original
    assert final.usage.cache_read_input_tokens > 0  # the same system prompt and document, cached by the engine

    with client.messages.stream(
        model="tiny", system=SYSTEM, messages=messages, max_tokens=4, extra_body=GREEDY, extra_headers=KEEP
    ) as stream:
        assert stream.get_final_message().content[0].text == text

    async def asynchronous() -> anthropic.types.Message:
        async with anthropic.AsyncAnthropic(base_url=gateway_url, api_key="unused", max_retries=0) as aclient:
            return await aclient.messages.create(
                model="tiny", system=SYSTEM, messages=messages, max_tokens=4, extra_body=GREEDY, extra_headers=KEEP
            )

    assert asyncio.run(asynchronous()).content[0].text == text


def test_a_messages_request_reads_what_the_equivalent_chat_reads(gateway_url, engine_backend, model_pair):
    """With tools and a transcript of tool_use / tool_result turns: the first token's log-probability of what the
    engine ran for the Messages request (a plain forward of its kept tokens at their positions) equals the one the
    equivalent chat reports through the same gateway, and both sent the same kept tokens at the same positions.
    (The Messages request goes before and after the chat: a prompt the gateway has just sent is filled to whole
    engine blocks, so each is compared in the same state.)"""
    _, recorder = engine_backend
    messages = _transcript()

    def anthropic_request() -> dict:
        raw = _client(gateway_url).messages.with_raw_response.create(
            model="tiny",
            system=SYSTEM,
            messages=messages,
            tools=TOOLS,
            max_tokens=1,
            extra_body=GREEDY,
            extra_headers=KEEP,
        )
        assert raw.headers["x-specprefill-status"] == "compressed"
        return recorder.last("/v1/messages")["body"]["vllm_xargs"]

    anthropic_request()
    chat = [{"role": "system", "content": SYSTEM}, messages[0]]
    for step in range(2):
        chat.append(
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": f"toolu_{step}",
                        "type": "function",
                        "function": {"name": "lookup_number", "arguments": json.dumps({"index": step})},
                    }
                ],
            }
        )
        chat.append({"role": "tool", "tool_call_id": f"toolu_{step}", "content": f"number {step}: {LONG_DOC[:200]}"})
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in TOOLS
    ]
    with openai_client(gateway_url) as client:
        answer = client.chat.completions.with_raw_response.create(
            model="tiny", messages=chat, tools=tools, max_tokens=1, temperature=0, logprobs=True, extra_headers=KEEP
        )
    assert answer.headers["x-specprefill-status"] == "compressed"
    chat_swap = recorder.last("/v1/chat/completions")["body"]["vllm_xargs"]
    swap = anthropic_request()
    assert swap == chat_swap
    model = load_causal_lm(model_pair / "target", device="cpu")
    expected = torch.log_softmax(reference_logits(model, swap["kept_token_ids"], swap["position_ids"]), -1)
    assert answer.parse().choices[0].logprobs.content[0].logprob == pytest.approx(float(expected.max()), abs=1e-4)
    # the tool definitions stayed whole: every token of their text is kept
    tokenizer = load_tokenizer(model_pair / "target")
    text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    start, end = text.index('{"type": "function"'), text.index("<|eot_id|>", text.index('{"type": "function"'))
    first, last = (len(tokenizer(text[:c], add_special_tokens=False).input_ids) for c in (start, end))
    assert set(range(first + 1, last - 1)) <= set(swap["position_ids"])


CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup_number", "arguments": '{"index": 2}'}}


def test_chat_tool_calls_become_tool_use_blocks_whole_and_streamed():
    """The reference engine's and the converted kinds' answers: a chat's tool call is Anthropic's ``tool_use``
    block, its arguments streamed as ``input_json_delta``; usage counts cache reads apart."""
    chat = {
        "id": "chatcmpl-1",
        "choices": [{"finish_reason": "tool_calls", "message": {"content": "Looking.", "tool_calls": [CALL]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    message = chat_to_message(chat, "tiny")
    assert message["content"] == [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "call_1", "name": "lookup_number", "input": {"index": 2}},
    ]
    assert message["stop_reason"] == "tool_use" and message["id"] == "msg_1"
    assert message["usage"] == {"input_tokens": 6, "cache_read_input_tokens": 4, "output_tokens": 3}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {"id": "chatcmpl-2", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    first = {**CALL, "index": 0, "function": {"name": "lookup_number", "arguments": '{"in'}}
    chunks = [
        chunk({"role": "assistant", "content": "Looking."}),
        chunk({"tool_calls": [first]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'dex": 2}'}}]}, "tool_calls"),
        {"id": "chatcmpl-2", "choices": [], "usage": chat["usage"]},
    ]

    async def events() -> list[dict]:
        async def source():
            for c in chunks:
                yield c

        return [e async for e in message_events(source(), "tiny")]

    got = asyncio.run(events())
    assert [e["type"] for e in got] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[5]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "lookup_number", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in got[6:8]) == '{"index": 2}'
    assert got[9]["delta"]["stop_reason"] == "tool_use" and got[9]["usage"]["cache_read_input_tokens"] == 4


def test_a_forced_tool_choice_is_compressed_and_reaches_the_engine(gateway_url, engine_backend):
    raw = _client(gateway_url).messages.with_raw_response.create(
        model="tiny",
        messages=_transcript(1),
        tools=TOOLS,
        tool_choice={"type": "any"},
        max_tokens=3,
        extra_headers=KEEP,
    )
    assert raw.headers["x-specprefill-status"] == "compressed" and raw.parse().content
    sent = engine_backend[1].last("/v1/messages")["body"]
    assert sent["tool_choice"] == {"type": "any"} and sent["tools"] == TOOLS


def test_a_server_tool_claude_offers_is_left_out(gateway_url, engine_backend):
    tools = [*TOOLS, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    raw = _client(gateway_url).messages.with_raw_response.create(
        model="tiny", messages=_transcript(1), tools=tools, max_tokens=3, extra_headers=KEEP
    )
    assert raw.headers["x-specprefill-tools-left-out"] == "web_search" and raw.parse().content
    assert engine_backend[1].last("/v1/messages")["body"]["tools"] == TOOLS


@pytest.mark.parametrize(
    "body,status,kind,says",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
        ({"messages": [], "max_tokens": 4}, 400, "invalid_request_error", "messages"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            400,
            "invalid_request_error",
            "max_tokens",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1.5},
            400,
            "invalid_request_error",
            "temperature",
        ),
        ({"messages": [{"role": "bot", "content": "hi"}], "max_tokens": 4}, 400, "invalid_request_error", "role"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "model": "nope"},
            404,
            "not_found_error",
            "nope",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "stop_sequences": ["a", "b", "c", "d", "e"],
            },
            400,
            "invalid_request_error",
            "stop_sequences",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,  # a server tool, required
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                "tool_choice": {"type": "tool", "name": "web_search"},
            },
            400,
            "invalid_request_error",
            "requires the web_search tool, which runs on Anthropic's servers",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [  # an image, for a model that reads text
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            },
                            {"type": "text", "text": "What is it?"},
                        ],
                    }
                ],
                "max_tokens": 4,
            },
            400,
            "invalid_request_error",
            "image_url parts",
        ),
    ],
)
def test_bad_messages_input_gets_anthropics_error_shape(gateway_url, body, status, kind, says):
    response = httpx.post(f"{gateway_url}/v1/messages", json={"model": "tiny", **body}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and says in error["error"]["message"]


def test_bad_headers_json_and_the_sdk_see_anthropics_errors(gateway_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(f"{gateway_url}/v1/messages", json=body, headers={"x-keep-rate": "2"}, timeout=30)
    assert response.status_code == 400 and "x-keep-rate" in response.json()["error"]["message"]
    response = httpx.post(
        f"{gateway_url}/v1/messages", content=b"{not json", timeout=30, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError, match="nope"):
        _client(gateway_url).messages.create(model="nope", messages=body["messages"], max_tokens=4)


def test_the_api_key_as_x_api_key_or_bearer(model_pair, engine_backend):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], api_key="sekret")
    with serve(create_app(settings)) as gw:
        message = _client(gw, api_key="sekret").messages.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert message.content
        with pytest.raises(anthropic.AuthenticationError):
            _client(gw, api_key="wrong").messages.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        response = httpx.post(f"{gw}/v1/messages/count_tokens", json=body, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
        response = httpx.post(f"{gw}/v1/messages/count_tokens", json=body, headers={"authorization": "Bearer sekret"})
        assert response.status_code == 200
        assert "x-api-key" not in engine_backend[1].last("/v1/messages")["headers"]  # the key is not forwarded


def test_count_tokens_counts_the_rendered_prompt(gateway_url):
    client = _client(gateway_url)
    messages = _transcript(1)
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages, tools=TOOLS)
    raw = client.messages.with_raw_response.create(
        model="tiny",
        system=SYSTEM,
        messages=messages,
        tools=TOOLS,
        max_tokens=1,
        extra_headers={"x-specprefill": "off"},
    )
    assert counted.input_tokens == int(raw.headers["x-specprefill-original-tokens"]) > 300


def test_a_swap_that_does_not_match_on_messages_goes_whole(model_pair, engine_backend, tmp_path):
    url, recorder = engine_backend
    body = {
        "model": "target",
        "messages": [{"role": "user", "content": LONG_DOC}],
        "max_tokens": 1,
        "vllm_xargs": {"kept_token_ids": [1, 2, 3], "position_ids": [0, 1, 2]},
    }
    response = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "at position 0 differs" in error["message"]
    target = target_with_another_template(model_pair, tmp_path)
    with serve(create_app(gateway_settings(model_pair, backend_url=url, target_model=str(target)))) as gw:
        raw = _client(gw).messages.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": LONG_DOC}], max_tokens=2, extra_headers=KEEP
        )
        assert raw.headers["x-specprefill-reason"] == "swap_mismatch" and raw.parse().content
        assert "vllm_xargs" not in recorder.last("/v1/messages")["body"]


@pytest.mark.parametrize("kind", ["tokens", "text"])
def test_backends_without_the_swap_answer_messages_converted(model_pair, engine_backend, kind):
    url, recorder = engine_backend
    with serve(create_app(gateway_settings(model_pair, backend_url=url, backend_kind=kind))) as gw:
        client = _client(gw)
        messages = [{"role": "user", "content": LONG_DOC + "\n\nWhat is the third number?"}]
        raw = client.messages.with_raw_response.create(
            model="tiny", system=SYSTEM, messages=messages, max_tokens=3, extra_body=GREEDY, extra_headers=KEEP
        )
        assert raw.headers["x-specprefill-status"] == "compressed"
        message = raw.parse()
        assert message.content[0].type == "text" and message.model == "tiny"
        assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == int(
            raw.headers["x-specprefill-original-tokens"]
        )
        with client.messages.stream(
            model="tiny", system=SYSTEM, messages=messages, max_tokens=3, extra_body=GREEDY, extra_headers=KEEP
        ) as stream:
            assert stream.get_final_message().content[0].text == message.content[0].text
        raw = client.messages.with_raw_response.create(
            model="tiny", messages=_transcript(1), tools=TOOLS, max_tokens=2, extra_headers=KEEP
        )
        if kind == "tokens":  # a token-ID completion cannot carry the tools: the chat goes whole, converted
            assert raw.headers["x-specprefill-reason"] == "unsupported_tools"
            assert recorder.last("/v1/chat/completions")["body"]["tools"][0]["function"]["name"] == "lookup_number"
        assert raw.parse().content

"""Every request compressed on the backend's own endpoints (the swap), through the OpenAI SDK: tools,
structured outputs, n, penalties and the Responses API against the reference engine; a rendering the engine
does not share goes whole, unseen by the client."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from common.models import load_causal_lm, load_tokenizer
from common.request_body import request_body
from gateway.app import create_app
from specprefill_lab.bench import parse_server_timing
from tests.helpers import (
    LONG_DOC,
    assert_swap_mismatch_is_a_400,
    engine_app,
    gateway_settings,
    openai_client,
    reference_logits,
    serve,
    target_with_another_template,
)
from tests.helpers import chat_messages as _messages

KEEP = {"x-keep-rate": "0.3"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_number",
            "description": "Find a number in the text",
            "parameters": {"type": "object", "properties": {"index": {"type": "integer"}}, "required": ["index"]},
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["answer", "colour"],
    "additionalProperties": False,
}


def test_a_chat_with_tools_reads_its_kept_tokens_at_their_positions(gateway_url, engine_backend, model_pair):
    """The first token's log-probability equals a plain forward of the kept tokens of the template-rendered prompt
    (tools included) at their positions; the tool definitions are kept whole."""
    _, recorder = engine_backend
    with openai_client(gateway_url) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=_messages(),
            tools=TOOLS,
            max_tokens=1,
            temperature=0,
            logprobs=True,
            extra_headers=KEEP,
        )
        first = raw.parse().choices[0].logprobs.content[0]
    assert raw.headers["x-specprefill-status"] == "compressed"
    sent = recorder.last("/v1/chat/completions")["body"]
    assert sent["tools"] == TOOLS and sent["messages"] == _messages()
    kept, positions = sent["vllm_xargs"]["kept_token_ids"], sent["vllm_xargs"]["position_ids"]
    tokenizer = load_tokenizer(model_pair / "target")
    text = tokenizer.apply_chat_template(_messages(), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    rendered = tokenizer(text, add_special_tokens=False).input_ids
    assert [rendered[p] for p in positions] == kept and positions[-1] == len(rendered) - 1
    start = text.index('{"type": "function"')
    end = text.index("<|eot_id|>", start)

    def n_tokens(chars: int) -> int:
        return len(tokenizer(text[:chars], add_special_tokens=False).input_ids)

    tools = set(range(n_tokens(start) + 1, n_tokens(end) - 1))  # inner tokens (a boundary may merge)
    assert len(tools) > 40 and tools <= set(positions)  # the tool definitions stayed whole
    model = load_causal_lm(model_pair / "target", device="cpu")
    expected = torch.log_softmax(reference_logits(model, kept, positions), -1)
    assert first.logprob == pytest.approx(float(expected.max()), abs=1e-4)  # greedy: the most likely token


def test_structured_output_n_and_penalties_are_the_engines(gateway_url):
    with openai_client(gateway_url) as client:
        _structured_n_and_penalties(client)


def _structured_n_and_penalties(client):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=_messages("Is there a third number?"),
        max_tokens=80,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
        extra_headers=KEEP,
    )
    assert raw.headers["x-specprefill-status"] == "compressed"
    answer = json.loads(raw.parse().choices[0].message.content)
    assert set(answer) == {"answer", "colour"} and answer["answer"] in ("yes", "no")
    assert answer["colour"] in ("red", "green", "blue")
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=_messages(), max_tokens=3, n=2, seed=1, presence_penalty=1.5, extra_headers=KEEP
    )
    assert raw.headers["x-specprefill-status"] == "compressed"
    assert [c.index for c in raw.parse().choices] == [0, 1]


def test_the_responses_api_streamed_and_not(gateway_url, engine_backend):
    with openai_client(gateway_url) as client:
        _responses(client, engine_backend[1])


def _responses(client, recorder):
    raw = client.responses.with_raw_response.create(
        model="tiny",
        instructions="Answer briefly.",
        input=LONG_DOC + "\n\nWhat is the third number?",
        max_output_tokens=4,
        temperature=0,
        extra_headers=KEEP,
    )
    assert raw.headers["x-specprefill-status"] == "compressed"
    response = raw.parse()
    assert response.status in ("completed", "incomplete") and response.output_text is not None
    assert response.model == "tiny" and response.usage.input_tokens == int(raw.headers["x-specprefill-original-tokens"])
    sent = recorder.last("/v1/responses")["body"]
    assert sent["instructions"] == "Answer briefly." and "kept_token_ids" in sent["vllm_xargs"]
    items = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": LONG_DOC}]},
    ]
    with client.responses.with_streaming_response.create(
        model="tiny", input=items, max_output_tokens=4, temperature=0, stream=True, extra_headers=KEEP
    ) as raw:
        assert raw.headers["x-specprefill-status"] == "compressed"
        events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and events[-1].response.model == "tiny"


def test_a_swap_that_does_not_match_is_a_400_and_through_the_gateway_goes_whole(model_pair, engine_backend, tmp_path):
    url, recorder = engine_backend
    assert_swap_mismatch_is_a_400(url)
    # a gateway whose chat template differs from the engine's (one word): its kept tokens are not the engine's
    target = target_with_another_template(model_pair, tmp_path)
    settings = gateway_settings(model_pair, backend_url=url, target_model=str(target))
    with serve(create_app(settings)) as gw, openai_client(gw) as client:
        for _ in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=_messages(), max_tokens=2, extra_headers=KEEP
            )
            assert raw.headers["x-specprefill-status"] == "bypassed"
            assert raw.headers["x-specprefill-reason"] == "swap_mismatch" and raw.parse().choices[0].message.content
            assert "vllm_xargs" not in recorder.last("/v1/chat/completions")["body"]
            # priced as what it is: the whole prompt (unpriced, a prediction of 0 counted as missed by 2x)
            assert parse_server_timing(raw.headers["server-timing"])["predicted"] > 0
        metrics = httpx.get(f"{gw}/metrics").text
        assert any(
            line.startswith("specprefill_swap_mismatch_total{") and line.endswith(" 2.0")
            for line in metrics.splitlines()
        )


class _RefusesSwapsMidStream:
    """An engine that answers a streamed swap with a 200 and an error as its first event, as vLLM's Messages
    stream answers a swap its plugin refuses; everything else it serves as it is."""

    def __init__(self, app, drops: bool = False) -> None:
        """``drops``: instead, a preamble event and then the connection dropped, as vLLM 0.32's Responses stream
        refuses a swap (its check comes after ``response.created``)."""
        self.app, self.refused, self.drops = app, 0, drops

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body = await request_body(receive)
        parsed = json.loads(body) if body else {}
        if parsed.get("stream") and "kept_token_ids" in (parsed.get("vllm_xargs") or {}):
            self.refused += 1
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            if self.drops:
                created = {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}}
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": f"event: response.created\ndata: {json.dumps(created)}\n\n".encode(),
                    }
                )
                raise RuntimeError("Caught handled exception, but response already started.")
            event = {"error": {"message": "kept token 9 at position 3 differs", "type": "BadRequestError", "code": 400}}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode()})
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def test_a_swap_refused_after_its_200_goes_whole_before_the_client_sees_anything(model_pair):
    engine = _RefusesSwapsMidStream(engine_app(model_pair))
    with (
        serve(engine) as url,
        serve(create_app(gateway_settings(model_pair, backend_url=url))) as gw,
        openai_client(gw) as client,
    ):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=_messages(), max_tokens=2, stream=True, extra_headers=KEEP
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    assert engine.refused == 1 and text
    assert raw.headers["x-specprefill-status"] == "bypassed" and raw.headers["x-specprefill-reason"] == "swap_mismatch"


def test_a_responses_swap_refused_by_a_dropped_stream_goes_whole(model_pair):
    engine = _RefusesSwapsMidStream(engine_app(model_pair), drops=True)
    with (
        serve(engine) as url,
        serve(create_app(gateway_settings(model_pair, backend_url=url, backend_kind="vllm"))) as gw,
        openai_client(gw) as client,
    ):
        raw = client.responses.with_raw_response.create(
            model="tiny", input=_messages()[1]["content"], max_output_tokens=2, stream=True, extra_headers=KEEP
        )
        kinds = [event.type for event in raw.parse()]
    assert engine.refused == 1 and kinds[-1] in ("response.completed", "response.incomplete") and "error" not in kinds
    assert raw.headers["x-specprefill-status"] == "bypassed" and raw.headers["x-specprefill-reason"] == "swap_mismatch"


SHELL = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}


def test_a_hosted_tool_a_responses_request_offers_is_left_out(gateway_url, engine_backend):
    """Codex CLI offers OpenAI's web_search to every model it does not know, beside its own function tools."""
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "tools": [{"type": "web_search"}, SHELL]}
    response = httpx.post(f"{gateway_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-specprefill-tools-left-out"] == "web_search"
    assert engine_backend[1].last("/v1/responses")["body"]["tools"] == [SHELL]  # nor does the engine see it
    alone = {**body, "tools": [{"type": "web_search_preview"}], "tool_choice": "auto"}
    response = httpx.post(f"{gateway_url}/v1/responses", json=alone, timeout=60)
    assert response.status_code == 200, response.text
    sent = engine_backend[1].last("/v1/responses")["body"]
    assert "tools" not in sent and "tool_choice" not in sent  # as if the client had sent none


@pytest.mark.parametrize(
    "choice",
    [
        {"tools": [{"type": "web_search"}, SHELL], "tool_choice": {"type": "web_search"}},
        {"tools": [{"type": "web_search"}], "tool_choice": "required"},
    ],
)
def test_a_responses_request_that_requires_a_hosted_tool_is_a_400_naming_it(gateway_url, choice):
    response = httpx.post(
        f"{gateway_url}/v1/responses",
        json={"model": "tiny", "input": "hi", "max_output_tokens": 2, **choice},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["param"] == "tool_choice"
        and "requires the web_search tool, which runs on OpenAI's servers" in error["message"]
    )


def test_a_hosted_tool_a_chat_offers_is_left_out_too(gateway_url, engine_backend):
    function = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    body = {"model": "tiny", "messages": _messages(), "max_tokens": 2, "tools": [{"type": "file_search"}, function]}
    response = httpx.post(f"{gateway_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-specprefill-tools-left-out"] == "file_search"

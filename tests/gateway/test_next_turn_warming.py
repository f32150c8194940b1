"""The warm behind a compressed turn covers the next turn's start: the whole prompt and then the answer as the
client sends it back. Real SDKs (OpenAI's chat and Responses, Anthropic's Messages, whole and streamed), a live
gateway with warming, the reference engine with its prefix cache; the client's next turn, asked of the engine
itself, finds all but its new message cached."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import pytest

from gateway.app import create_app
from tests.gateway.test_planner import COSTS
from tests.helpers import (
    LONG_DOC,
    engine_app,
    eventually,
    gateway_settings,
    gateway_settled,
    openai_client,
    requests_with_gaps,
    serve,
)

SYSTEM = "You answer questions about the text below.\n\n" + LONG_DOC
BLOCK = 16
ANSWER = 48  # tokens: longer than a block or two, so that warming the prompt alone falls short of the next turn
GREEDY = {"temperature": 0, "ignore_eos": True}


def _chat(gw: str, stream: bool) -> tuple[list[dict], int]:
    """One turn through the OpenAI SDK: the next turn's messages (the answer as the SDK gives it back, then a new
    question) and the turn's prompt tokens."""
    client = openai_client(gw)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What comes first?"}]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=ANSWER,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=GREEDY,
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        answer, prompt_tokens = {"role": "assistant", "content": text}, chunks[-1].usage.prompt_tokens
    else:
        completion = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=ANSWER, extra_body=GREEDY
        )
        answer = completion.choices[0].message.model_dump(exclude_none=True)
        prompt_tokens = completion.usage.prompt_tokens
    return [*messages, answer, {"role": "user", "content": "And what comes last?"}], prompt_tokens


def _messages(gw: str, stream: bool) -> tuple[list[dict], int]:
    """One turn through Anthropic's SDK, as Claude Code sends it: streamed, the system prompt apart."""
    messages: list[dict] = [{"role": "user", "content": "What comes first?"}]
    fields = dict(model="tiny", system=SYSTEM, messages=messages, max_tokens=ANSWER, extra_body=GREEDY)
    with anthropic.Anthropic(base_url=gw, api_key="unused", max_retries=0) as client:  # its sockets closed
        if stream:
            with client.messages.stream(**fields) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**fields)
    answer = {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]}
    prompt_tokens = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    return [*messages, answer, {"role": "user", "content": "And what comes last?"}], prompt_tokens


def _responses(gw: str, stream: bool) -> tuple[list[dict], int]:
    """One turn through OpenAI's Responses API, as Codex CLI sends it: the output items appended to the input."""
    client = openai_client(gw)
    items: list[dict] = [{"type": "message", "role": "user", "content": "What comes first?"}]
    fields = dict(model="tiny", instructions=SYSTEM, input=items, max_output_tokens=ANSWER, extra_body=GREEDY)
    if stream:
        events = list(client.responses.create(**fields, stream=True))
        response = next(e.response for e in events if e.type in ("response.completed", "response.incomplete"))
    else:
        response = client.responses.create(**fields)
    output = [item.model_dump(exclude_none=True) for item in response.output]
    question = {"type": "message", "role": "user", "content": "And what comes last?"}
    return [*items, *output, question], response.usage.input_tokens


def _engine_cached(engine_url: str, api: str, turn: list[dict]) -> tuple[int, int]:
    """The next turn asked of the engine itself: its prompt tokens, and how many its prefix cache served."""
    if api == "chat":
        body = {"model": "target", "messages": turn, "max_tokens": 1}
        usage = httpx.post(f"{engine_url}/v1/chat/completions", json=body, timeout=120).json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    if api == "messages":
        body = {"model": "target", "system": SYSTEM, "messages": turn, "max_tokens": 1}
        usage = httpx.post(f"{engine_url}/v1/messages", json=body, timeout=120).json()["usage"]
        return usage["input_tokens"] + usage["cache_read_input_tokens"], usage["cache_read_input_tokens"]
    body = {"model": "target", "instructions": SYSTEM, "input": turn, "max_output_tokens": 1}
    usage = httpx.post(f"{engine_url}/v1/responses", json=body, timeout=120).json()["usage"]
    return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]


TURNS = {"chat": _chat, "messages": _messages, "responses": _responses}


@pytest.mark.parametrize(
    "api,stream",
    [
        ("chat", False),
        ("chat", True),
        ("messages", True),
        ("messages", False),
        ("responses", False),
        ("responses", True),
    ],
)
def test_a_compressed_turn_warms_its_answer_too(model_pair, api, stream):
    with serve(engine_app(model_pair, block_size=BLOCK)) as engine_url:
        settings = gateway_settings(
            model_pair, backend_url=engine_url, planner="cost", warming=True, cost_coefficients=COSTS
        )
        with serve(create_app(settings)) as gw:
            requests_with_gaps(gw)
            turn, prompt_tokens = TURNS[api](gw, stream)
            assert asyncio.run(eventually(lambda: gateway_settled(gw), within=60))
            metrics = httpx.get(f"{gw}/metrics").text
            assert 'specprefill_warming_total{outcome="done"}' in metrics  # the turn was compressed, then warmed
            n, cached = _engine_cached(engine_url, api, turn)
    new = 16  # the new question, its message's opening and the generation prompt: about ten tokens here
    assert cached >= (n - new) // BLOCK * BLOCK - BLOCK  # all but the new message (the last block may straddle)
    assert cached >= prompt_tokens + ANSWER - 2 * BLOCK  # the answer too, not only the prompt it answered

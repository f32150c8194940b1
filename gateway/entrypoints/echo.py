"""The answer as its client sends it back. A chat's next turn begins with this turn's prompt and its answer, so
the warm behind a compressed turn (``gateway.planning.warming``) warms both, rendered as the next turn renders
them: an engine that answered from the kept tokens holds neither the whole prompt nor the answer after it, while
an engine that read the whole prompt holds both when the next turn comes.

Each API shape's answer, whole or streamed, is gathered into what its client appends to the conversation: chat,
the assistant message; Messages, the assistant message's content blocks; Responses, the output items. Only a
finished answer counts (a client that left mid-answer sends something else next)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from gateway.dispatch.answer import Answer

PROBE = "Next"  # a stand-in for the next message: the warm ends where its text would begin


class Gather:
    """One answer, gathered as its client echoes it."""

    def __init__(self) -> None:
        self.done = False  # the answer finished

    def whole(self, body: dict[str, Any]) -> None:
        raise NotImplementedError

    def event(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

    def echo(self) -> Any:
        raise NotImplementedError


class ChatGather(Gather):
    """A chat answer's first choice as the assistant message a client appends (content, tool calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def whole(self, body: dict[str, Any]) -> None:
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        self.content = [message.get("content") or ""]
        self.calls = dict(enumerate(message.get("tool_calls") or ()))
        self.done = choice.get("finish_reason") is not None

    def event(self, event: dict[str, Any]) -> None:
        for choice in event.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            self.content.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                entry = self.calls.setdefault(
                    call.get("index", len(self.calls)), {"type": "function", "function": {"arguments": ""}}
                )
                function = call.get("function") or {}
                entry["id"] = call.get("id") or entry.get("id")
                entry["function"]["name"] = function.get("name") or entry["function"].get("name")
                entry["function"]["arguments"] += function.get("arguments") or ""
            self.done |= choice.get("finish_reason") is not None

    def echo(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.calls:
            message["tool_calls"] = [self.calls[index] for index in sorted(self.calls)]
        return message


class MessageGather(Gather):
    """A Messages answer as the assistant message's content blocks (text, tool_use, thinking)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json: dict[int, list[str]] = {}  # tool inputs as they stream

    def whole(self, body: dict[str, Any]) -> None:
        self.blocks = dict(enumerate(body.get("content") or ()))
        self.done = body.get("stop_reason") is not None

    def event(self, event: dict[str, Any]) -> None:
        kind, index = event.get("type"), event.get("index", 0)
        if kind == "content_block_start":
            self.blocks[index] = dict(event.get("content_block") or {})
        elif kind == "content_block_delta" and index in self.blocks:
            delta, block = event.get("delta") or {}, self.blocks[index]
            for field, key in (("text", "text"), ("thinking", "thinking"), ("signature", "signature")):
                if isinstance(delta.get(field), str):
                    block[key] = block.get(key, "") + delta[field]
            if isinstance(delta.get("partial_json"), str):
                self.json.setdefault(index, []).append(delta["partial_json"])
        elif kind == "message_delta":
            self.done |= (event.get("delta") or {}).get("stop_reason") is not None

    def echo(self) -> list[dict[str, Any]]:
        for index, parts in self.json.items():
            try:
                self.blocks[index]["input"] = json.loads("".join(parts) or "{}")
            except ValueError:
                pass
        return [self.blocks[index] for index in sorted(self.blocks)]


class ResponseGather(Gather):
    """A Response's output items, as a Responses client appends them to its input."""

    def __init__(self) -> None:
        super().__init__()
        self.output: list[dict[str, Any]] = []

    def whole(self, body: dict[str, Any]) -> None:
        self.output = list(body.get("output") or ())
        self.done = body.get("status") in ("completed", "incomplete")  # incomplete: cut at max_output_tokens

    def event(self, event: dict[str, Any]) -> None:
        if event.get("type") in ("response.completed", "response.incomplete") and isinstance(
            event.get("response"), dict
        ):
            self.whole(event["response"])

    def echo(self) -> list[dict[str, Any]]:
        return self.output


def echoed(answer: Answer, gather: Gather, answered: Callable[[Any], None]) -> Answer:
    """``answer`` as it goes to the client, with ``answered(echo)`` called once it has finished."""
    if answer.body is not None:
        gather.whole(answer.body)
        if gather.done:
            answered(gather.echo())
        return answer
    return answer.map(lambda body: body, lambda stream: _watched(stream, gather, answered))


async def _watched(
    stream: AsyncGenerator[dict[str, Any], None], gather: Gather, answered: Callable[[Any], None]
) -> AsyncGenerator[dict[str, Any], None]:
    try:
        async for event in stream:
            gather.event(event)
            yield event
    finally:
        await stream.aclose()
    if gather.done:  # not reached where the client left, or the stream failed
        answered(gather.echo())

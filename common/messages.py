"""Anthropic's Messages API on top of chat: the request as chat messages, chat answers as Messages answers and
stream events, and Anthropic's error shape.

``MessagesRequest.as_chat`` converts a request exactly as vLLM's Anthropic serving does
(``vllm/entrypoints/anthropic/serving.py``, ``to_chat_completion_request``): the system text joined without a
separator, Claude Code's billing header dropped, ``tool_use`` blocks as the assistant's tool calls with JSON
arguments, a user's ``tool_result`` blocks as tool messages before the rest of that user turn, tools as chat
functions. So a Messages prompt renders token for token as vLLM renders it, the gateway scores what vLLM's
``/v1/messages`` will read, and the swap matches there. The reference engine serves ``/v1/messages`` with the
same conversion.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Hashable
from typing import Any, Literal

import jinja2
import jinja2.sandbox
from pydantic import Field, ValidatorFunctionWrapHandler, model_validator
from transformers import PreTrainedTokenizerBase

from common.errors import APIError, InvalidRequestError, parse_body
from common.hosted_tools import anthropic_forced, anthropic_server, leave_out_offered
from common.max_tokens import OutputLimit
from common.protocol import ChatCompletionRequest, SpecPrefillOptions, WireModel
from common.telemetry import request_id

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request hash: it would defeat prefix caching
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class ContentBlock(WireModel):
    """A content block: text, image, tool_use, tool_result, thinking (``cache_control`` is accepted and ignored:
    the engine's prefix cache and the planner do that work)."""

    type: str
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    tool_use_id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    tool: dict[str, Any] | None = None  # tool_addition / tool_removal: {"type": "tool_reference", "name": ...} or
    # {"type": "tool_definition", "definition": {...}} (tools announced or withdrawn mid-conversation)


class MessageParam(WireModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolParam(WireModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None
    defer_loading: bool | None = None  # advanced tool use: announced, its schema loaded when searched for


class ToolChoice(WireModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Conversation(WireModel):
    """What a Messages request and a token count share: the prompt."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _hosted_tools(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Tools with a ``type`` (web search, code execution, Anthropic's computer, bash and editor tools) run on
        Anthropic's servers or take Anthropic's own schemas, which a chat template renders neither of: offered,
        they are left out; required, a 400 (``common.hosted_tools``)."""
        data, left = leave_out_offered(data, anthropic_server, anthropic_forced, "Anthropic")
        request = handler(data)
        request._tools_left_out = left
        return request

    def chat_messages(self, merge_inline_system: bool = False) -> list[dict[str, Any]]:
        """The conversation as chat messages, as vLLM converts it (``merge_inline_system``: system messages
        inside ``messages`` join the leading system prompt, for templates that allow only one, as vLLM detects)."""
        messages: list[dict[str, Any]] = []
        system = (
            [self.system]
            if isinstance(self.system, str)
            else [
                b.text
                for b in self.system or ()
                if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)
            ]
        )
        if merge_inline_system:
            system += [text for m in self.messages if m.role == "system" and (text := _system_text(m))]
        if any(system):
            messages.append({"role": "system", "content": "".join(system)})
        for message in self.messages:
            if message.role == "system":
                if not merge_inline_system and (text := _system_text(message)):
                    messages.append({"role": "system", "content": text})
                continue
            chat: dict[str, Any] = {"role": message.role}
            if isinstance(message.content, str):
                chat["content"] = message.content
            else:
                _convert_blocks(message, chat, messages)
            if not (message.role == "user" and "content" not in chat):
                messages.append(chat)
        return messages

    def chat_fields(self, merge_inline_system: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": self.model, "messages": self.chat_messages(merge_inline_system)}
        choice = self.tool_choice
        if choice is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function",
                "function": {"name": choice.name},
            }
        tools = self.resolved_tools()
        if tools is not None:
            fields["tools"] = [_chat_tool(tool) for tool in tools]
            fields.setdefault("tool_choice", "auto")
        return fields

    def resolved_tools(self) -> list[ToolParam] | None:
        """The tools in effect at the end of the conversation, as vLLM resolves them (chat templates see one
        list): ``tools``, then each ``tool_addition`` block (a tool by value is declared; one by name is no longer
        deferred) and ``tool_removal`` block in the messages, in order."""
        changes = [
            block
            for message in self.messages
            if not isinstance(message.content, str)
            for block in message.content
            if block.type in ("tool_addition", "tool_removal")
        ]
        if not changes:
            return self.tools
        tools = {tool.name: tool for tool in self.tools or []}
        removed: set[str] = set()
        for block in changes:
            change = block.tool or {}
            if change.get("type") == "tool_definition":
                definition = ToolParam.model_validate(change.get("definition") or {})
                name, tools[definition.name] = definition.name, definition
            else:
                name = str(change.get("name"))
                if name not in tools:
                    raise InvalidRequestError(
                        f"{block.type} names the tool {name!r}, which is not in tools", param="messages"
                    )
                if block.type == "tool_addition":
                    tools[name] = tools[name].model_copy(update={"defer_loading": None})
            if block.type == "tool_removal":
                removed.add(name)
            else:
                removed.discard(name)
        return [tool for name, tool in tools.items() if name not in removed]

    def as_chat(self, merge_inline_system: bool = False) -> ChatCompletionRequest:
        return _chat(self.chat_fields(merge_inline_system))


class MessagesRequest(Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    # --- extensions ---
    vllm_xargs: dict[str, Any] | None = None
    specprefill: SpecPrefillOptions | None = None

    def as_chat(self, merge_inline_system: bool = False) -> ChatCompletionRequest:
        """The chat vLLM makes of this request (the sampling fields too, so the chat path can serve it)."""
        fields = self.chat_fields(merge_inline_system)
        fields.update(max_tokens=self.max_tokens, stream=self.stream)
        for name, value in (
            ("stop", self.stop_sequences),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k),
            ("vllm_xargs", self.vllm_xargs),
        ):
            if value is not None:
                fields[name] = value
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        chat = _chat(fields)
        chat._output_limit = OutputLimit("max_tokens", clamp=True)  # Claude Code asks for 32,000 whatever the model
        return chat


def _chat(fields: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return parse_body(ChatCompletionRequest, fields)
    except InvalidRequestError as exc:  # a limit of the chat path, said in the Messages API's names
        if exc.param == "stop":
            raise InvalidRequestError(
                "stop_sequences takes at most 4 non-empty strings here", param="stop_sequences"
            ) from None
        raise


def _chat_tool(tool: ToolParam) -> dict[str, Any]:
    schema = dict(tool.input_schema)
    schema.setdefault("type", "object")  # as vLLM fills it in: last
    function: dict[str, Any] = {"name": tool.name, "description": tool.description, "parameters": schema}
    if tool.strict is not None:
        function["strict"] = tool.strict
    if tool.defer_loading is not None:
        function["defer_loading"] = tool.defer_loading
    return {"type": "function", "function": function}


def _system_text(message: MessageParam) -> str | None:
    if isinstance(message.content, str):
        return None if message.content.startswith(BILLING_HEADER) else message.content
    parts = [b.text for b in message.content if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER)]
    return "".join(parts) if parts else None


def _convert_blocks(message: MessageParam, chat: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    assert not isinstance(message.content, str)  # text content is converted whole
    for block in message.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            calls.append(
                {
                    "id": block.id or f"call_{int(time.time())}",
                    "type": "function",
                    "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})},
                }
            )
        elif block.type == "tool_result":
            if message.role == "user":
                _append_tool_result(block, messages)
            else:
                parts.append({"type": "text", "text": f"Tool result: {str(block.content) if block.content else ''}"})
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts


def _append_tool_result(block: ContentBlock, messages: list[dict[str, Any]]) -> None:
    """A user's tool result as a tool message; its images as a user message after it, and the tools it names
    as a second tool message (as vLLM does: those are not text, and such requests go whole)."""
    parts = block.content if isinstance(block.content, list) else []
    text = (
        block.content
        if isinstance(block.content, str)
        else "\n".join(p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text")
    )
    messages.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text or ""})
    images = [_image_url(p.get("source", {})) for p in parts if isinstance(p, dict) and p.get("type") == "image"]
    if images := [url for url in images if url]:
        messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    named = [
        p.get("tool_name") or p.get("name") for p in parts if isinstance(p, dict) and p.get("type") == "tool_reference"
    ]
    if named := [name for name in named if name]:
        messages.append(
            {
                "role": "tool",
                "tool_call_id": block.tool_use_id or "",
                "content": [{"type": "tool_reference", "name": name} for name in named],
            }
        )


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def merges_inline_system(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the model's chat template refuses a system message after the first turn (vLLM then merges
    them into the leading system prompt): the template is rendered with one, as vLLM probes it."""
    templates: list[str | None] = []
    tools: list[dict[str, Any]] | None
    for tools in (None, []):
        try:
            templates.append(tokenizer.get_chat_template(tools=tools))
        except (ValueError, TypeError):
            templates.append(None)
    return any(_refuses_inline_system(t) for t in templates)


def _refuses_inline_system(template: str | None) -> bool:
    if not template:
        return True
    probe = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.from_string(template).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


# --- answers ---


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """A chat usage in Anthropic's terms: ``input_tokens`` are those not read from the cache."""
    chat_usage = chat_usage or {}
    out: dict[str, Any] = {"output_tokens": chat_usage.get("completion_tokens") or 0}
    prompt = chat_usage.get("prompt_tokens") or 0
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(cached, int):
        out["cache_read_input_tokens"] = cached
        prompt -= cached
    out["input_tokens"] = max(0, prompt)
    return out


def stop_reason(finish_reason: str | None, matched: Any, tool_used: bool) -> tuple[str | None, str | None]:
    """An OpenAI finish reason as Anthropic's ``(stop_reason, stop_sequence)``."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_used or finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def chat_to_message(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A ``chat.completion`` as a Messages answer."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or _tool_id(),
                "name": function.get("name", ""),
                "input": _arguments(function.get("arguments")),
            }
        )
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
    return {
        "id": _message_id(chat.get("id")),
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],
        "model": model,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat.get("usage")),
    }


async def message_events(
    chunks: AsyncGenerator[dict[str, Any], None], model: str
) -> AsyncGenerator[dict[str, Any], None]:
    """``chat.completion.chunk`` objects as Anthropic's stream events: ``message_start``, ``ping``, then per
    content block ``content_block_start`` / ``_delta`` (``text_delta``, ``input_json_delta``) / ``_stop``, then
    ``message_delta`` (stop reason, usage) and ``message_stop``. The chat stream must carry its usage."""
    blocks = _Blocks()
    finish, matched, chat_usage, started = None, None, None, False
    try:
        async for chunk in chunks:
            if not started:
                started = True
                yield _message_start(chunk, model)
                yield {"type": "ping"}
            chat_usage = chunk.get("usage") or chat_usage
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
                matched = choice.get("stop_reason", matched)
                delta = choice.get("delta") or {}
                if delta.get("reasoning"):
                    for event in blocks.open("thinking", {"type": "thinking", "thinking": ""}):
                        yield event
                    yield blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning"]})
                if delta.get("content"):
                    for event in blocks.open("text", {"type": "text", "text": ""}):
                        yield event
                    yield blocks.delta({"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") or {}
                    if call.get("id") is not None and function.get("name") is not None:
                        for event in blocks.open(
                            ("tool_use", call["id"]),
                            {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}},
                        ):
                            yield event
                    if function.get("arguments") and blocks.kind is not None:
                        yield blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]})
        if not started:
            return
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(finish or "stop", matched, blocks.tool_used)
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(chat_usage),
        }
        yield {"type": "message_stop"}
    finally:
        await chunks.aclose()


def _message_start(chunk: dict[str, Any], model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"id": _message_id(chunk.get("id")), "type": "message", "role": "assistant"}
    message |= {"content": [], "model": model, "stop_reason": None, "stop_sequence": None}
    message["usage"] = usage(chunk.get("usage"))
    return {"type": "message_start", "message": message}


class _Blocks:
    """The content block being streamed: a new kind (or another tool call) closes it and opens the next."""

    def __init__(self) -> None:
        self.index, self.tool_used = -1, False
        self.kind: Hashable | None = None  # "text", "thinking", or ("tool", its index)

    def open(self, kind: Hashable, block: dict[str, Any]) -> list[dict[str, Any]]:
        if kind == self.kind:
            return []
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        self.tool_used |= block["type"] == "tool_use"
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]


def _arguments(arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _message_id(source: str | None) -> str:
    return "msg_" + (source or uuid.uuid4().hex).removeprefix("chatcmpl-").removeprefix("cmpl-")


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


# --- errors ---


def error_body(exc: APIError) -> dict[str, Any]:
    """Anthropic's error shape. The parameter goes in the message, as vLLM's Anthropic errors carry it."""
    message = exc.message
    if exc.param and f"parameter={exc.param}" not in message:
        message = f"{message} (parameter={exc.param})"
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(exc.status_code, "api_error"), "message": message},
    }
    if (request := request_id()) is not None:  # as Anthropic's own errors carry it
        body["request_id"] = request
    return body


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "context_management": {"original_input_tokens": input_tokens}}

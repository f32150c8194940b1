"""OpenAI's Responses API on top of chat: the request as chat messages (the way vLLM renders it), and chat
answers as Response objects and Responses stream events.

The gateway renders a Responses request with ``as_chat`` to score it, and forwards the client's body to the
backend's ``/v1/responses`` with the swap; the reference engine serves ``/v1/responses`` with the same
conversion, so both read the same prompt. Input items a chat cannot hold (an earlier turn's reasoning, tools
announced mid-conversation as Codex CLI sends them) are left out, with a debug log, as vLLM leaves out what
its template cannot render; a ``previous_response_id`` is refused with a 400 (it needs a stored response).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any, cast

from pydantic import Field, ValidatorFunctionWrapHandler, model_validator

from common.errors import InvalidRequestError
from common.hosted_tools import leave_out_offered, openai_forced, openai_hosted
from common.max_tokens import OutputLimit
from common.protocol import ChatCompletionRequest, SpecPrefillOptions, WireModel

logger = logging.getLogger("specprefill")


class ResponsesRequest(WireModel):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    previous_response_id: str | None = None
    # --- extensions ---
    vllm_xargs: dict[str, Any] | None = None
    specprefill: SpecPrefillOptions | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _hosted_tools(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> ResponsesRequest:
        data, left = leave_out_offered(data, openai_hosted, openai_forced, "OpenAI")
        request = cast(ResponsesRequest, handler(data))
        request._tools_left_out = left
        return request

    def as_chat(self) -> ChatCompletionRequest:
        """The chat this request renders as (instructions as the system turn, items as messages, flat tools as
        chat tools), as vLLM's Responses serving builds it."""
        if self.previous_response_id is not None:
            raise InvalidRequestError(
                "previous_response_id needs the stored response; send the conversation as input items instead",
                param="previous_response_id",
            )
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for item in self.input:
                _append_item(messages, item)
        if not messages:
            raise InvalidRequestError("the input is empty", param="input")
        # vLLM tokenizes a Responses prompt with the special tokens added (a second BOS after the template's own)
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "add_special_tokens": True,
        }
        if self.tools:
            fields["tools"] = [_chat_tool(tool) for tool in self.tools]
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("vllm_xargs", self.vllm_xargs),
        ):
            if value is not None:
                fields[name] = value
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        chat = ChatCompletionRequest.model_validate(fields)
        chat._output_limit = OutputLimit("max_output_tokens")
        return chat


def _append_item(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        content = item.get("content")
        if isinstance(content, list):
            content = [
                {"type": "text", "text": part.get("text")}
                if part.get("type") in ("input_text", "output_text")
                else part
                for part in content
            ]
        messages.append({"role": item.get("role", "user"), "content": content})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
    else:  # reasoning, additional_tools, ...: nothing a chat template renders
        logger.debug("a Responses input item of type %r is left out of the prompt", kind)


ENGINE_ITEMS = ("message", "function_call", "function_call_output", "custom_tool_call_output", "reasoning")


def engine_input(items: Any) -> Any:
    """The input items an engine's own ``/v1/responses`` renders (vLLM 0.32's: messages, function calls and their
    outputs, reasoning in the clear); the rest (Codex CLI's ``additional_tools``, encrypted reasoning), which vLLM
    refuses with a 400 ("Unsupported input item type") and no chat template renders, left out with a debug log,
    as ``as_chat`` leaves them out of the gateway's own rendering."""
    if not isinstance(items, list):
        return items
    kept = []
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind in ENGINE_ITEMS and not (kind == "reasoning" and item.get("encrypted_content")):
            kept.append(item)
        else:
            logger.debug("a Responses input item of type %r is left out of the backend's request", kind)
    return kept


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or "function" in tool:
        return tool
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def usage_from_chat(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A chat usage as Responses usage (input/output tokens, cached input tokens)."""
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def response_object(
    request: ResponsesRequest,
    model: str,
    text: str,
    *,
    response_id: str,
    created: int,
    status: str = "completed",
    usage: dict[str, Any] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """A Response with one assistant message (empty while in progress)."""
    output = []
    if status != "in_progress":
        output.append(_message_item(response_id, text, "completed"))
    body = {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "output": output,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto",
        "parallel_tool_calls": True,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
        "usage": usage,
    }
    if finish_reason == "length":
        body["status"] = "incomplete"
    return body


def _message_item(response_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []
    return {
        "id": "msg_" + response_id.removeprefix("resp_"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def chat_to_response(request: ResponsesRequest, chat: dict[str, Any], model: str) -> dict[str, Any]:
    choice = (chat.get("choices") or [{}])[0]
    return response_object(
        request,
        model,
        (choice.get("message") or {}).get("content") or "",
        response_id=f"resp_{uuid.uuid4().hex}",
        created=int(time.time()),
        usage=usage_from_chat(chat.get("usage")),
        finish_reason=choice.get("finish_reason"),
    )


async def response_events(
    request: ResponsesRequest, chunks: AsyncGenerator[dict[str, Any], None], model: str
) -> AsyncGenerator[dict[str, Any], None]:
    """Chat chunks as OpenAI's Responses stream events (created ... output_text.delta ... completed)."""
    response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    item_id = "msg_" + response_id.removeprefix("resp_")
    sequence = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(sequence), **fields}

    def response(
        status: str, text: str = "", usage: dict[str, Any] | None = None, finish: str | None = None
    ) -> dict[str, Any]:
        return response_object(
            request,
            model,
            text,
            response_id=response_id,
            created=created,
            status=status,
            usage=usage,
            finish_reason=finish,
        )

    try:
        yield event("response.created", response=response("in_progress"))
        yield event("response.in_progress", response=response("in_progress"))
        yield event("response.output_item.added", output_index=0, item=_message_item(response_id, "", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": []}
        yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part)
        text, usage, finish = "", None, None
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                delta = (choice.get("delta") or {}).get("content") or ""
                if delta:
                    text += delta
                    yield event(
                        "response.output_text.delta",
                        item_id=item_id,
                        output_index=0,
                        content_index=0,
                        delta=delta,
                        logprobs=[],
                    )
        yield event(
            "response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text, logprobs=[]
        )
        part = {"type": "output_text", "text": text, "annotations": []}
        yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=_message_item(response_id, text, "completed"))
        done = response("completed", text, usage_from_chat(usage), finish)
        yield event(f"response.{done['status']}", response=done)
    finally:
        await chunks.aclose()

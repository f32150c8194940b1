"""Chat on top of completions: rendering with the model's chat template, and completion answers as chat answers.

Shared by the gateway (which sends chat prompts to completion backends as token IDs) and the reference
engine's own ``/v1/chat/completions``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import jinja2
import numpy as np
from transformers import PreTrainedTokenizerBase

from common.errors import InvalidRequestError
from common.protocol import ChatMessage


@dataclass(slots=True)
class RenderedChat:
    """A chat as the target model reads it: the template's text, its tokens, and each token's character span."""

    text: str
    token_ids: list[int]
    offsets: np.ndarray  # int64 [N, 2]: each token's character span in ``text``
    ids: np.ndarray | None = None  # ``token_ids`` as an int64 array, where the tokenizer made one
    _order: Any = field(default=False, init=False, repr=False, compare=False)  # ``_ordered``'s, once
    _spans: Any = field(default=None, init=False, repr=False, compare=False)  # (messages, their spans), once

    def content_spans(self, messages: list[ChatMessage]) -> list[tuple[int, int] | None]:
        """Each message's content as a character span of the text (None where the template changed it); found
        once for a request's messages (the system prompt's tokens, the last message's start and a text backend's
        kept messages each ask: an agent's 50 messages took 0.5 ms a search)."""
        if self._spans is not None and self._spans[0] is messages:
            return cast("list[tuple[int, int] | None]", self._spans[1])
        spans: list[tuple[int, int] | None] = []
        cursor = 0
        for message in messages:
            content = message.text()
            start = self.text.find(content, cursor) if content else -1
            if start == -1:
                spans.append(None)
                continue
            cursor = start + len(content)
            spans.append((start, cursor))
        self._spans = (messages, spans)
        return spans

    def tokens_in(self, span: tuple[int, int]) -> list[int]:
        """Indices of the tokens that start inside a character span."""
        return np.flatnonzero(self.token_mask(span)).tolist()

    def mark(self, mask: np.ndarray, span: tuple[int, int]) -> None:
        """``mask |= token_mask(span)``, in place: two binary searches where the tokens' starts are in order (an
        agent's prompt of 40,000 tokens and 20 messages took 2 ms of full-length masks a request)."""
        order = self._ordered()
        if order is None:
            mask |= self.token_mask(span)
            return
        index, starts = order
        low, high = np.searchsorted(starts, span, side="left")
        mask[index[low:high] if index is not None else slice(low, high)] = True

    def _ordered(self) -> tuple[np.ndarray | None, np.ndarray] | None:
        """The tokens with a width (their indices; None where every token has one) and their starts, where those
        starts never go back; else None."""
        if self._order is False:
            starts, ends = self.offsets[:, 0], self.offsets[:, 1]
            wide = ends > starts
            index = None if bool(wide.all()) else np.flatnonzero(wide)
            ordered = starts if index is None else starts[index]
            self._order = (index, ordered) if bool(np.all(ordered[1:] >= ordered[:-1])) else None
        return cast("tuple[np.ndarray | None, np.ndarray] | None", self._order)

    def token_mask(self, span: tuple[int, int]) -> np.ndarray:
        """Boolean [S]: the tokens that start inside a character span (vectorised: a long system prompt's
        12,000 tokens take microseconds, not a Python loop's milliseconds)."""
        starts, ends = self.offsets[:, 0], self.offsets[:, 1]
        return (ends > starts) & (starts >= span[0]) & (starts < span[1])


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    encode: Callable[[str], tuple[np.ndarray, np.ndarray]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
    text: str | None = None,
) -> RenderedChat:
    """The prompt the target model reads, with the generation prompt appended, as vLLM renders it (tools go to
    the template). ``encode(text) -> (ids, offsets)``, both int64 arrays, replaces a plain tokenization (a
    ``tokenize.PieceCache``'s ``encode_arrays``). ``text``: ``chat_text`` of the same messages and tools, where
    the caller has it already."""
    if text is None:
        text = chat_text(tokenizer, messages, tools)
    if encode is not None and not add_special_tokens:
        ids, offsets = encode(text)
        return RenderedChat(text, ids.tolist(), offsets, ids)
    encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return RenderedChat(text, encoding.input_ids, np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2))


def chat_text(
    tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> str:
    """The chat as the template writes it, with the generation prompt appended (``render_chat``'s text); a
    template that rejects the messages or tools is the client's 400."""
    plain = developer_as_system([m.for_template() for m in messages], tokenizer.chat_template)
    try:
        return template_text(tokenizer, plain, template_tools(tools))
    except (jinja2.TemplateError, TypeError) as exc:  # TypeError: a tool or tool call the template cannot print
        raise InvalidRequestError(
            f"the model's chat template rejected the messages or tools: {exc}", param="messages"
        ) from None
    except ValueError as exc:  # no chat template
        raise InvalidRequestError(str(exc), param="messages") from None


def template_text(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    """``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)``, the
    same compiled template rendering the same values, without transformers' copies of every message and tool
    first (its guard against rich objects, such as decoded images, in a caller's inputs: these are JSON's own
    types, made fresh for this request, and the template's sandbox cannot change them). On an agent's turn of 25
    tools and 25 tool calls the copies were 0.8 of the template's 1.4 ms. Where transformers' helpers are not the
    ones this was written against, ``apply_chat_template`` itself; a test holds the two equal on real templates."""
    if _TEMPLATE_HELPERS is None:
        return str(
            tokenizer.apply_chat_template(
                cast(Any, messages), tools=cast(Any, tools), tokenize=False, add_generation_prompt=True
            )
        )
    compile_template, alias_reasoning, plain_data = _TEMPLATE_HELPERS
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    template = compile_template(tokenizer.get_chat_template(None, tools))
    chat = alias_reasoning([{k: v for k, v in m.items() if v is not None} for m in messages])  # as it normalizes
    return str(
        template.render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=True,
            **plain_data(tokenizer.special_tokens_map),
        )
    )


def _template_helpers() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None:
    try:
        from transformers.utils.chat_template_utils import (
            _alias_reasoning_fields,
            _compile_jinja_template,
            _plain_template_data,
        )
    except ImportError:
        return None
    return _compile_jinja_template, _alias_reasoning_fields, _plain_template_data


_TEMPLATE_HELPERS = _template_helpers()


def developer_as_system(messages: list[dict[str, Any]], template: str | dict[str, str] | None) -> list[dict[str, Any]]:
    """vLLM's rendering of OpenAI's ``developer`` role for a chat template that does not name it (ChatML's,
    among most): each developer message becomes a system one, and where a system message then stands anywhere
    but first, or there are several, they are merged into one at the front, their contents joined by a blank
    line (vLLM's ``_convert_developer_to_system`` and ``_consolidate_system_messages``). Codex CLI sends its
    instructions as developer messages: rendered otherwise, vLLM refuses every swap of its prompts."""
    if not any(m["role"] == "developer" for m in messages) or _names_developer(template):
        return messages
    converted = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    for m in converted:
        if m["role"] == "system":
            m.pop("tools", None)
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0] or not systems:
        return converted
    merged = "\n\n".join(c for i in systems if (c := converted[i].get("content")))
    return [{"role": "system", "content": merged}, *(m for m in converted if m["role"] != "system")]


def _names_developer(template: str | dict[str, str] | None) -> bool:
    if isinstance(template, dict):  # named templates: vLLM uses the default one for a chat without tools
        template = template.get("default") or next(iter(template.values()), None)
    return isinstance(template, str) and ('"developer"' in template or "'developer'" in template)


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Chat tools as vLLM hands them to the template (its request model's dump): ``type`` then ``function``
    with ``name``, ``description`` (null where absent) and ``parameters``; ``strict`` only where set."""
    if not tools:
        return None
    out = []
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            out.append(tool)
            continue
        dumped = {
            "name": function.get("name"),
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        if (defer := function.get("defer_loading", tool.get("defer_loading"))) is not None:
            dumped["defer_loading"] = defer
        entry = {"type": "function", "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def completion_to_chat(body: dict[str, Any], model: str) -> dict[str, Any]:
    """A ``text_completion`` answer as a ``chat.completion``."""
    choices = []
    for choice in body.get("choices", []):
        chat_choice = {
            "index": choice.get("index", 0),
            "message": {"role": "assistant", "content": choice.get("text", "")},
            "logprobs": _chat_logprobs(choice.get("logprobs")),
            "finish_reason": choice.get("finish_reason"),
        }
        choices.append(chat_choice)
    out = {
        "id": _chat_id(body),
        "object": "chat.completion",
        "created": body.get("created", int(time.time())),
        "model": model,
        "choices": choices,
    }
    if body.get("usage") is not None:
        out["usage"] = body["usage"]
    return out


class ChatChunkConverter:
    """Turns a stream of ``text_completion`` chunks into ``chat.completion.chunk`` objects.

    The first chunk carries the assistant role; each later one a content delta; finish_reason and the
    usage chunk (``stream_options.include_usage``) pass through.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self.chat_id: str | None = None
        self.sent_role = False

    def convert(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self.chat_id is None:
            self.chat_id = _chat_id(chunk)
        out = []
        for choice in chunk.get("choices", []):
            delta: dict[str, Any] = {"content": choice.get("text", "")}
            if not self.sent_role:
                delta = {"role": "assistant", **delta}
                self.sent_role = True
            out.append(
                self._chunk(
                    [
                        {
                            "index": choice.get("index", 0),
                            "delta": delta,
                            "logprobs": _chat_logprobs(choice.get("logprobs")),
                            "finish_reason": choice.get("finish_reason"),
                        }
                    ],
                    chunk,
                )
            )
        if not chunk.get("choices") and chunk.get("usage") is not None:
            out.append(self._chunk([], chunk))
        return out

    def _chunk(self, choices: list[Any], source: dict[str, Any]) -> dict[str, Any]:
        chunk = {
            "id": self.chat_id,
            "object": "chat.completion.chunk",
            "created": source.get("created", int(time.time())),
            "model": self.model,
            "choices": choices,
        }
        if "usage" in source:
            chunk["usage"] = source["usage"]
        return chunk


def _chat_id(body: dict[str, Any]) -> str:
    source = body.get("id") or uuid.uuid4().hex
    return "chatcmpl-" + source.removeprefix("cmpl-")


def _token_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _chat_logprobs(logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
    """Completion logprobs ({tokens, token_logprobs, top_logprobs}) in the chat shape ({content: [...]})."""
    if not logprobs:
        return None
    content = []
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs.get("tokens", []))
    for token, logprob, top in zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []), tops):
        entry = _token_entry(token, logprob)
        entry["top_logprobs"] = [_token_entry(t, lp) for t, lp in (top or {}).items()]
        content.append(entry)
    return {"content": content}


async def as_chat_chunks(
    chunks: AsyncGenerator[dict[str, Any], None], converter: ChatChunkConverter
) -> AsyncGenerator[dict[str, Any], None]:
    """``text_completion`` chunks as ``chat.completion.chunk`` objects; closing this closes ``chunks``."""
    try:
        async for chunk in chunks:
            for chat_chunk in converter.convert(chunk):
                yield chat_chunk
    finally:
        await chunks.aclose()

"""Chat on top of completions: the request models, rendering with the chat template, answer conversion.

Shared by the gateway (which sends chat prompts to completion backends as token IDs) and the reference
engine's own ``/v1/chat/completions``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import jinja2
from pydantic import Field, field_validator

from specprefill.openai_api import InvalidRequestError, WireModel


class StreamOptions(WireModel):
    include_usage: bool = False


class SpecPrefillOptions(WireModel):
    keep_rate: float | None = None


class SamplingFields(WireModel):
    """The sampling fields that chat and completion requests share and that backends reproduce exactly."""

    model: str = Field(description="the served model's name")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    """vLLM's extension, forwarded to backends that know it (the reference engine, vLLM)."""
    # --- extensions ---
    specprefill: SpecPrefillOptions | None = None
    """Per-request options (``extra_body={"specprefill": {"keep_rate": 0.2}}`` in the OpenAI SDK)."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return value

    def unsupported_features(self) -> list[str]:
        """Fields whose effect the token-ID completion path cannot reproduce."""
        found = []
        if self.n != 1:
            found.append("n")
        if self.presence_penalty or self.frequency_penalty:
            found.append("penalties")
        if self.logit_bias:
            found.append("logit_bias")
        return found


class ChatMessage(WireModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"only text content parts are supported, got {part.get('type')!r}", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_features(self) -> list[str]:
        found = super().unsupported_features()
        if self.tools or self.functions:
            found.append("tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            found.append("response_format")
        return found

    def completion_params(self) -> dict[str, Any]:
        """The fields of an equivalent ``/v1/completions`` body."""
        params = _sampling_params(self)
        params["max_tokens"] = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        return params


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_features(self) -> list[str]:
        found = super().unsupported_features()
        if self.echo:
            found.append("echo")
        if self.suffix:
            found.append("suffix")
        if self.best_of not in (None, 1):
            found.append("best_of")
        return found

    def completion_params(self) -> dict[str, Any]:
        params = _sampling_params(self)
        params["max_tokens"] = self.max_tokens if self.max_tokens is not None else 16
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return prompt


def _sampling_params(request: SamplingFields) -> dict[str, Any]:
    params: dict[str, Any] = {"temperature": request.temperature, "top_p": request.top_p, "stream": request.stream}
    if request.seed is not None:
        params["seed"] = request.seed
    if request.ignore_eos:
        params["ignore_eos"] = True
    if request.stop:
        params["stop"] = request.stop
    if request.stream and request.stream_options is not None:
        params["stream_options"] = {"include_usage": request.stream_options.include_usage}
    return params


def render_chat(tokenizer, messages: list[ChatMessage]) -> tuple[str, list[int]]:
    """The prompt text and token IDs the target model reads, with the generation prompt appended."""
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"the model's chat template rejected the messages: {exc}", param="messages") from None
    except ValueError as exc:  # no chat template
        raise InvalidRequestError(str(exc), param="messages") from None
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return text, ids


def completion_to_chat(body: dict, model: str) -> dict:
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

    def convert(self, chunk: dict) -> list[dict]:
        if self.chat_id is None:
            self.chat_id = _chat_id(chunk)
        out = []
        for choice in chunk.get("choices", []):
            delta: dict[str, Any] = {"content": choice.get("text", "")}
            if not self.sent_role:
                delta = {"role": "assistant", **delta}
                self.sent_role = True
            out.append(self._chunk([{
                "index": choice.get("index", 0),
                "delta": delta,
                "logprobs": _chat_logprobs(choice.get("logprobs")),
                "finish_reason": choice.get("finish_reason"),
            }], chunk))
        if not chunk.get("choices") and chunk.get("usage") is not None:
            out.append(self._chunk([], chunk))
        return out

    def _chunk(self, choices: list, source: dict) -> dict:
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


def _chat_id(body: dict) -> str:
    source = body.get("id") or uuid.uuid4().hex
    return "chatcmpl-" + source.removeprefix("cmpl-")


def _token_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _chat_logprobs(logprobs: dict | None) -> dict | None:
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

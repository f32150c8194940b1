"""OpenAI's chat and completion requests, as the gateway and the reference engine both read them."""

from __future__ import annotations

import json
import logging
from typing import Any, Self, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from transformers import PreTrainedTokenizerBase

from common.errors import InvalidRequestError
from common.hosted_tools import leave_out_offered, openai_forced, openai_hosted
from common.max_tokens import OutputLimit

logger = logging.getLogger("specprefill")

MAX_TOKENS, MAX_COMPLETION_TOKENS = OutputLimit("max_tokens"), OutputLimit("max_completion_tokens")  # frozen: shared


class WireModel(BaseModel):
    """Base of the request models: unknown fields are tolerated (and logged), as OpenAI clients send many."""

    model_config = ConfigDict(extra="allow")
    _tools_left_out: list[str] = PrivateAttr(default_factory=list)

    @property
    def tools_left_out(self) -> list[str]:
        """Hosted tools the client offered and the model does not see (``common.hosted_tools``)."""
        return self._tools_left_out

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> Self:
        if self.model_extra:
            logger.debug("ignoring unknown fields in %s: %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(WireModel):
    include_usage: bool = False


class SpecPrefillOptions(WireModel):
    keep_rate: float | str | None = None  # a decimal in (0, 1], or "auto"
    auto_target: float | None = None  # auto: the share of the score mass the kept chunks reach
    auto_floor: float | None = None  # auto: the least keep rate it applies
    auto_ceiling: float | None = None  # auto: the most


class SamplingFields(WireModel):
    """The sampling fields that chat and completion requests share."""

    model: str = Field(description="the served model's name")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    """Read back as a list (empty when unset)."""
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # --- extensions ---
    ignore_eos: bool = False
    """vLLM's extension: keep generating past EOS (the reference engine and vLLM know it)."""
    vllm_xargs: dict[str, Any] | None = None
    """vLLM's per-request extension (it reaches ``SamplingParams.extra_args``); carries the swap (``common.swap``)."""
    specprefill: SpecPrefillOptions | None = None
    """Per-request options (``extra_body={"specprefill": {"keep_rate": 0.2}}`` in the OpenAI SDK)."""
    _output_limit: OutputLimit | None = PrivateAttr(None)  # a request converted from another API's: that API's

    @property
    def output_limit(self) -> OutputLimit:
        """The field the client asked for tokens with, and whether one past the room is lowered or refused."""
        return self._output_limit or MAX_TOKENS

    def lower_max_tokens(self, tokens: int) -> None:
        """Asks for ``tokens`` instead (a Messages request's room left)."""
        self.max_tokens = tokens

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def unsupported_features(self) -> list[str]:
        """Fields whose effect the token-ID completion path cannot reproduce."""
        found = []
        if self.n != 1:
            found.append("n")
        if self.presence_penalty or self.frequency_penalty:
            found.append("penalties")
        if self.logit_bias:
            found.append("logit_bias")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            found.append("response_format")
        if (self.model_extra or {}).get("top_k") not in (None, 0, -1):  # vLLM's (and Anthropic's) extension
            found.append("top_k")
        return found

    def _sampling_params(self) -> dict[str, Any]:
        """The sampling fields of an equivalent completion. Temperature and top_p only where the client set them:
        an engine fills the rest with its own defaults (vLLM with the model's ``generation_config.json``), as it
        does for the client's body sent whole, so a compressed request is sampled as the whole one is."""
        params: dict[str, Any] = {
            name: getattr(self, name) for name in ("temperature", "top_p") if name in self.model_fields_set
        }
        params["stream"] = self.stream
        if self.seed is not None:
            params["seed"] = self.seed
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.stop:
            params["stop"] = self.stop
        if self.stream and self.stream_options is not None:
            params["stream_options"] = {"include_usage": self.stream_options.include_usage}
        return params

    def generation_params(self) -> dict[str, Any]:
        """What an engine that renders the prompt itself needs beyond the completion fields (set ones only)."""
        fields = ("n", "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "vllm_xargs")
        return {name: getattr(self, name) for name in fields if name in self.model_fields_set}


class ChatMessage(WireModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as the chat template reads it: text parts joined by newlines, as vLLM joins them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"only text content parts are supported, got {part.get('type')!r}", param="messages"
                )
            parts.append(part["text"])
        return "\n".join(parts)

    def has_only_text(self) -> bool:
        return not isinstance(self.content, list) or all(part.get("type") in TEXT_PARTS for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (vLLM's way: tool-call arguments as objects, not strings)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_parsed_arguments(call) for call in self.tool_calls]
        reasoning = (self.model_extra or {}).get("reasoning")
        if self.role == "assistant" and isinstance(reasoning, str):  # interleaved thinking, as vLLM passes it
            message["reasoning"] = message["reasoning_content"] = reasoning
        return message


TEXT_PARTS = ("text", "input_text", "output_text")


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    # --- extensions ---
    add_special_tokens: bool = False
    """vLLM's: also add the tokenizer's special tokens (BOS) to the rendered chat; vLLM's Responses API does."""

    @model_validator(mode="wrap")
    @classmethod
    def _hosted_tools(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Self:
        data, left = leave_out_offered(data, openai_hosted, openai_forced, "OpenAI")
        request = cast(Self, handler(data))
        request._tools_left_out = left
        return request

    def unsupported_features(self) -> list[str]:
        found = super().unsupported_features()
        if self.tools or self.functions:
            found.append("tools")
        return found

    @property
    def output_limit(self) -> OutputLimit:
        if self._output_limit is None and self.max_completion_tokens is not None:
            return MAX_COMPLETION_TOKENS
        return super().output_limit

    def lower_max_tokens(self, tokens: int) -> None:
        if self.max_completion_tokens is not None:
            self.max_completion_tokens = tokens
        self.max_tokens = tokens

    def completion_params(self) -> dict[str, Any]:
        """The fields of an equivalent ``/v1/completions`` body."""
        params = self._sampling_params()
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
        params = self._sampling_params()
        params["max_tokens"] = self.max_tokens if self.max_tokens is not None else 16
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        return params

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of one is unwrapped); empty or batched prompts are a 400."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return cast("str | list[int]", prompt)  # a batch of one unwrapped: text or token IDs

    def prompt_token_ids(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None) -> list[int]:
        """The prompt's token IDs as an engine makes them: text through the tokenizer (special tokens added, as
        vLLM does), token IDs checked against the tokenizer's vocabulary (and the model's, if smaller)."""
        prompt = self.single_prompt()
        if isinstance(prompt, str):
            ids: list[int] = tokenizer(prompt).input_ids
            if not ids:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            return ids
        vocab = min(len(tokenizer), vocab_size or len(tokenizer))
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token IDs must be in [0, {vocab})", param="prompt")
        return list(prompt)

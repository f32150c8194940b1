"""OpenAI completions on top of the reference engine: validation, then answers as plain dicts.

The HTTP server wraps these dicts as JSON or SSE; the gateway's embedded mode consumes them directly,
exactly as it consumes a remote backend's parsed stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any, cast

from common.chat import ChatChunkConverter, as_chat_chunks, completion_to_chat, render_chat
from common.errors import InvalidRequestError, NotFoundError
from common.messages import Conversation, MessagesRequest, chat_to_message, merges_inline_system, message_events
from common.models import load_causal_lm, load_tokenizer
from common.prompt_bound import refuse_unfittable
from common.protocol import TEXT_PARTS, ChatCompletionRequest, ChatMessage, SamplingFields
from common.responses import ResponsesRequest, chat_to_response, response_events
from common.streams import merge, prepend
from common.swap import requested_swap, swap_prompt
from common.tokenize import PieceCache
from engine.engine import ReferenceEngine
from engine.kv_events import EventPublisher, KVEventsConfig
from engine.prefix_cache import PrefixCache
from engine.protocol import EngineCompletionRequest
from engine.sampling import SamplingParams
from engine.sequence import StepOutput
from engine.settings import EngineSettings
from engine.structured import json_parser


@dataclass(slots=True)
class PreparedRequest:
    token_ids: list[int]
    position_ids: list[int]
    params: SamplingParams
    priority: int = 0


class EngineServing:
    def __init__(
        self,
        engine: ReferenceEngine,
        served_names: list[str],
        events: EventPublisher | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.events = events  # the KV cache events' publisher, if any
        self.served_names = served_names
        self.max_new_tokens = max_new_tokens  # every request's cap, whatever it asks
        self.pieces = PieceCache(engine.tokenizer)  # chats' repeated parts tokenized once, long new ones in parallel
        self.merge_inline_system = merges_inline_system(engine.tokenizer)  # for Messages, as vLLM decides it

    @classmethod
    def from_settings(
        cls, settings: EngineSettings, on_active_change: Callable[[int], None] | None = None
    ) -> EngineServing:
        """Loads the target model and starts its engine."""
        events = None
        if settings.kv_events_config and settings.kv_cache_tokens:
            config = KVEventsConfig.parse(settings.kv_events_config)
            events = EventPublisher(config) if config.enable_kv_cache_events and config.publisher == "zmq" else None
        model = load_causal_lm(settings.model, device=settings.device, dtype=settings.dtype)
        prefix_cache = (
            PrefixCache(settings.kv_cache_tokens, settings.block_size, publish=events.publish if events else None)
            if settings.kv_cache_tokens
            else None
        )
        engine = ReferenceEngine(
            model,
            load_tokenizer(settings.model),
            max_running=settings.max_running,
            max_waiting=settings.max_waiting,
            prefill_chunk=settings.prefill_chunk,
            background_prefill_chunk=settings.background_prefill_chunk,
            prefix_cache=prefix_cache,
            on_active_change=on_active_change,
        )
        names = [n for n in (settings.served_model_name, settings.model, *settings.model_alias) if n]
        return cls(engine, list(dict.fromkeys(names)), events, settings.max_new_tokens)

    def close(self) -> None:
        self.engine.close()
        if self.events is not None:
            self.events.close()

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def models(self) -> dict[str, Any]:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "specprefill",
                    "max_model_len": self.engine.max_positions,
                }
            ],
        }

    def prepare(self, request: EngineCompletionRequest) -> PreparedRequest:
        """Typed 4xx errors for everything a client can get wrong."""
        if request.model is not None and request.model not in self.served_names:
            raise NotFoundError(
                f"model {request.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        _check_supported(request)
        refuse_unfittable(request, self.engine.tokenizer, self.engine.max_positions, "the engine")
        token_ids = request.prompt_token_ids(self.engine.tokenizer, self.engine.vocab_size)
        position_ids: list[int]
        if (swap := requested_swap(request.vllm_xargs)) is not None:  # the kept tokens, in place of the prompt
            token_ids, position_ids = swap_prompt(token_ids, *swap)
        else:
            position_ids = request.sent_position_ids() or list(range(len(token_ids)))
        _check_positions(position_ids, len(token_ids), self.engine.max_positions)
        last = position_ids[-1]
        room = self.engine.max_positions - 1 - last
        if request.max_tokens is not None and request.max_tokens <= 0:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt ends at position {last}, the model's last "
                f"({self.engine.max_positions} positions): no room for a token",
                param="max_tokens",
            )
        # at most what fits in the model's positions, as vLLM lowers it (agents ask for 32,000-128,000)
        max_tokens = min(request.max_tokens, room) if request.max_tokens is not None else room
        if self.max_new_tokens is not None:
            max_tokens = min(max_tokens, self.max_new_tokens)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=cast(list[str], request.stop),  # its validator made it a list
            logprobs=request.logprobs,
            ignore_eos=request.ignore_eos,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=_logit_bias(request.logit_bias, self.engine.vocab_size),
            json_parser=json_parser(request.response_format),
        )
        return PreparedRequest(token_ids, position_ids, params, request.priority)

    def _choices(
        self, request: EngineCompletionRequest, prepared: PreparedRequest
    ) -> list[AsyncGenerator[StepOutput, None]]:
        """One generation per choice (``n``); a seeded request's choices take consecutive seeds."""
        generations: list[AsyncGenerator[StepOutput, None]] = []
        for i in range(request.n):
            params = prepared.params
            if i and params.seed is not None:
                params = replace(params, seed=params.seed + i)
            generations.append(
                self.engine.generate(prepared.token_ids, prepared.position_ids, params, prepared.priority)
            )
        return generations

    async def completion_stream(self, request: EngineCompletionRequest) -> AsyncGenerator[dict[str, Any], None]:
        """OpenAI ``text_completion`` chunks; the usage chunk last when asked for."""
        prepared = self.prepare(request)
        chunks = self._stream(request, prepared)
        # run to the first token here, so that admission errors (a full queue: 503) come before any byte is sent
        first = await anext(chunks)
        return prepend(first, chunks)

    async def _stream(
        self, request: EngineCompletionRequest, prepared: PreparedRequest
    ) -> AsyncGenerator[dict[str, Any], None]:
        completion_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        n_generated, offsets, cached = 0, [0] * request.n, 0
        async for index, step in merge(self._choices(request, prepared)):
            n_generated, cached = n_generated + 1, step.cached_tokens
            choice = {"index": index, "text": step.text, "logprobs": None, "finish_reason": step.finish_reason}
            if prepared.params.logprobs is not None:
                choice["logprobs"] = self._logprobs([step], offsets[index])
            if request.return_token_ids:
                choice["token_ids"] = [step.token_id]
            offsets[index] += len(step.text)
            chunk = _envelope(completion_id, created, self.model_name, [choice])
            if include_usage:
                chunk["usage"] = None
            yield chunk
        if include_usage:
            yield _envelope(
                completion_id, created, self.model_name, [], _usage(len(prepared.token_ids), n_generated, cached)
            )

    async def completion(self, request: EngineCompletionRequest) -> dict[str, Any]:
        prepared = self.prepare(request)
        runs: list[list[StepOutput]] = [[] for _ in range(request.n)]
        async for index, step in merge(self._choices(request, prepared)):
            runs[index].append(step)
        choices = []
        for index, steps in enumerate(runs):
            choice = {
                "index": index,
                "text": "".join(s.text for s in steps),
                "logprobs": self._logprobs(steps, 0) if prepared.params.logprobs is not None else None,
                "finish_reason": steps[-1].finish_reason,
            }
            if request.return_token_ids:
                choice["token_ids"] = [s.token_id for s in steps]
            choices.append(choice)
        usage = _usage(len(prepared.token_ids), sum(len(steps) for steps in runs), runs[0][-1].cached_tokens)
        return _envelope(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, choices, usage)

    def _chat_as_completion(self, request: ChatCompletionRequest) -> EngineCompletionRequest:
        """The chat rendered as vLLM renders it (tools in the template); the swap then applies to its tokens."""
        _check_supported(request)
        if not all(m.has_only_text() for m in request.messages):
            kinds = sorted(
                {str(part.get("type")) for m in request.messages if not m.has_only_text() for part in _parts(m)}
                - set(TEXT_PARTS)
            )
            raise InvalidRequestError(
                f"the reference engine reads text content parts only, and this chat has "
                f"{', '.join(kinds)} parts (a model without vision): send text",
                param="messages",
            )
        refuse_unfittable(request, self.engine.tokenizer, self.engine.max_positions, "the engine")
        ids = render_chat(
            self.engine.tokenizer,
            request.messages,
            self.pieces.encode_arrays,
            tools=request.tools,
            add_special_tokens=request.add_special_tokens,
        ).token_ids
        return EngineCompletionRequest(
            model=request.model, prompt=ids, **request.completion_params(), **request.generation_params()
        )

    async def chat_completion(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """Chat through the model's chat template, so the engine stands in for any OpenAI-compatible server."""
        body = await self.completion(self._chat_as_completion(request))
        return completion_to_chat(body, self.model_name)

    async def chat_completion_stream(self, request: ChatCompletionRequest) -> AsyncGenerator[dict[str, Any], None]:
        chunks = await self.completion_stream(self._chat_as_completion(request))
        return as_chat_chunks(chunks, ChatChunkConverter(self.model_name))

    async def responses(self, request: ResponsesRequest) -> dict[str, Any]:
        """OpenAI's Responses API through the chat template (the request as vLLM renders it)."""
        return chat_to_response(request, await self.chat_completion(request.as_chat()), self.model_name)

    async def responses_stream(self, request: ResponsesRequest) -> AsyncGenerator[dict[str, Any], None]:
        chunks = await self.chat_completion_stream(request.as_chat())
        return response_events(request, chunks, self.model_name)

    async def messages(self, request: MessagesRequest) -> dict[str, Any]:
        """Anthropic's Messages API through the chat template (converted as vLLM converts it); takes the swap."""
        chat = await self.chat_completion(request.as_chat(self.merge_inline_system))
        return chat_to_message(chat, self.model_name)

    async def messages_stream(self, request: MessagesRequest) -> AsyncGenerator[dict[str, Any], None]:
        chunks = await self.chat_completion_stream(request.as_chat(self.merge_inline_system))
        return message_events(chunks, self.model_name)

    def count_tokens(self, request: Conversation) -> int:
        """The prompt tokens a Messages request renders to."""
        if request.model not in self.served_names:
            raise NotFoundError(
                f"model {request.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        chat = request.as_chat(self.merge_inline_system)
        return len(
            render_chat(self.engine.tokenizer, chat.messages, self.pieces.encode_arrays, tools=chat.tools).token_ids
        )

    def _logprobs(self, steps: list[StepOutput], offset: int) -> dict[str, Any]:
        decode = self.engine.tokenizer.decode
        tokens: list[str] = []
        offsets: list[int] = []
        for step in steps:
            tokens.append(str(decode([step.token_id])) if step.token_id is not None else "")  # a final flush
            offsets.append(offset)
            offset += len(step.text)
        return {
            "tokens": tokens,
            "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [
                {decode([t]): lp for t, lp in s.top_logprobs.items()} if s.top_logprobs else None for s in steps
            ],
            "text_offset": offsets,
        }


def _parts(message: ChatMessage) -> list[dict[str, Any]]:
    return message.content if isinstance(message.content, list) else []


def _check_supported(request: SamplingFields) -> None:
    """What the reference engine does not do (as vLLM V1 does not do suffix or best_of)."""
    unsupported: list[str] = [n for n in ("echo", "suffix", "best_of") if n in request.unsupported_features()]
    if getattr(request, "functions", None):
        unsupported.append("functions")
    if unsupported:
        raise InvalidRequestError(
            f"the reference engine does not support {', '.join(unsupported)}", param=unsupported[0]
        )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    try:
        out = {int(token): float(value) for token, value in (bias or {}).items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token IDs", param="logit_bias") from None
    if any(not 0 <= token < vocab_size for token in out) or any(not -100 <= v <= 100 for v in out.values()):
        raise InvalidRequestError(
            f"logit_bias takes token IDs in [0, {vocab_size}) and values in [-100, 100]", param="logit_bias"
        )
    return out


def _check_positions(positions: list[int], n_tokens: int, max_positions: int) -> None:
    if len(positions) != n_tokens:
        raise InvalidRequestError(
            f"position_ids has {len(positions)} entries for {n_tokens} prompt tokens; give one per token",
            param="position_ids",
        )
    if positions[0] < 0:
        raise InvalidRequestError("position_ids must be non-negative", param="position_ids")
    if any(b <= a for a, b in zip(positions, positions[1:])):
        raise InvalidRequestError("position_ids must be strictly increasing", param="position_ids")
    if positions[-1] >= max_positions:
        raise InvalidRequestError(
            f"position_ids must be below the model's max_position_embeddings ({max_positions})",
            param="position_ids",
        )


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens served from the prefix cache where vLLM and OpenAI report them."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(
    completion_id: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    body = {"id": completion_id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body

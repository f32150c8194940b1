"""The gateway's work per request: the prologue (checks, tokens, plan), forwarding, and the answer's shape.

A request flows one way: router -> policy -> planner -> backend -> answer. Nothing here knows HTTP
routing; the routers in ``app.py`` only parse and choose the response type.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.chat import ChatChunkConverter, as_chat_chunks, completion_to_chat, render_chat
from common.errors import InvalidRequestError, NotFoundError, parse_body
from common.protocol import ChatCompletionRequest, CompletionRequest
from gateway.backends import Backend, token_body
from gateway.draft import DraftClient
from gateway.metrics import GatewayMetrics
from gateway.plan import Plan, Planner
from gateway.policy import request_options
from gateway.settings import GatewaySettings
from gateway.text_kind import kept_messages, kept_text


@dataclass(slots=True)
class Answer:
    plan: Plan
    body: dict | None = None
    stream: AsyncIterator[dict] | None = None


@dataclass(slots=True)
class Prompt:
    """A request's prompt as the target reads it."""

    token_ids: list[int]
    text: str | None = None  # the rendered chat, for the text kind


class GatewayServing:
    def __init__(self, settings: GatewaySettings, tokenizer, draft: DraftClient, backend: Backend,
                 metrics: GatewayMetrics, served_names: list[str], planner: Planner) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.draft = draft
        self.backend = backend
        self.metrics = metrics
        self.served_names = served_names
        self.planner = planner

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    async def close(self) -> None:
        await self.backend.close()
        await self.draft.close()
        await self.planner.scores.close()

    # --- the prologue every chat and completion request takes ---

    def prompt(self, request: ChatCompletionRequest | CompletionRequest) -> Prompt:
        """The prompt's tokens as the backend would make them (chat template; special tokens added, like vLLM)."""
        if isinstance(request, ChatCompletionRequest):
            if len(request.messages) > self.settings.max_messages:
                raise InvalidRequestError(f"the chat has {len(request.messages)} messages; this gateway accepts at "
                                          f"most {self.settings.max_messages}", param="messages")
            text, ids = render_chat(self.tokenizer, request.messages)
            return Prompt(ids, text)
        return Prompt(request.prompt_token_ids(self.tokenizer))

    def check_limits(self, request: ChatCompletionRequest | CompletionRequest, token_ids: list[int]) -> None:
        """The gateway's own limits, before any draft or backend work."""
        settings = self.settings
        limit = settings.max_prompt_tokens or _tokenizer_limit(self.tokenizer)
        if limit is not None and len(token_ids) > limit:
            param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
            raise InvalidRequestError(f"the prompt has {len(token_ids)} tokens; this gateway accepts at most {limit}",
                                      param=param, code="context_length_exceeded")
        requested = request.completion_params().get("max_tokens")
        if requested is not None and requested > settings.max_tokens_limit:
            raise InvalidRequestError(f"max_tokens is {requested}; this gateway allows at most "
                                      f"{settings.max_tokens_limit}", param="max_tokens")

    def check_model(self, model: str) -> None:
        if model not in self.served_names:
            raise NotFoundError(f"model {model!r} does not exist; this gateway serves {self.model_name!r}",
                                param="model", code="model_not_found")

    async def _planned(self, request: ChatCompletionRequest | CompletionRequest, headers) -> tuple[Plan, Prompt]:
        self.check_model(request.model)
        options = request_options(headers, request.specprefill, self.settings.keep_rate)
        start = time.perf_counter()
        prompt = self.prompt(request)
        tokenize_ms = (time.perf_counter() - start) * 1e3
        self.check_limits(request, prompt.token_ids)
        plan = await self.planner.plan(prompt.token_ids, options, request.unsupported_features())
        plan.tokenize_ms = tokenize_ms
        return plan, prompt

    # --- requests ---

    async def chat(self, request: ChatCompletionRequest, headers) -> Answer:
        plan, prompt = await self._planned(request, headers)
        backend_model = await self.backend.model_name()
        kind = self.backend.kind
        if plan.passthrough or (kind == "text" and plan.kept_indices is None):
            return await self._forward_chat(plan, _passthrough_body(request, backend_model))
        if kind == "text":
            body = _passthrough_body(request, backend_model)
            body["messages"] = kept_messages(self.tokenizer, request.messages, prompt.text, plan.token_ids,
                                             plan.kept_indices)
            return await self._forward_chat(plan, body)
        body = token_body(kind, backend_model, plan.kept_token_ids(), plan.kept_indices,
                          request.completion_params())
        converter = ChatChunkConverter(self.model_name)
        if request.stream:
            stream = await self._timed(plan, self.backend.completion_stream(body))
            return Answer(plan, stream=self._rewrite_stream(as_chat_chunks(stream, converter), plan))
        answer = await self._timed(plan, self.backend.completion(body))
        return Answer(plan, body=self._rewrite(completion_to_chat(answer, self.model_name), plan))

    async def completion(self, request: CompletionRequest, headers) -> Answer:
        plan, _ = await self._planned(request, headers)
        backend_model = await self.backend.model_name()
        kind = self.backend.kind
        if plan.passthrough or (kind == "text" and plan.kept_indices is None):
            body = _passthrough_body(request, backend_model)
        elif kind == "text":
            body = {"model": backend_model, "prompt": kept_text(self.tokenizer, plan.token_ids, plan.kept_indices),
                    **request.completion_params()}
        else:
            body = token_body(kind, backend_model, plan.kept_token_ids(), plan.kept_indices,
                              request.completion_params())
        if request.stream:
            stream = await self._timed(plan, self.backend.completion_stream(body))
            return Answer(plan, stream=self._rewrite_stream(stream, plan))
        return Answer(plan, body=self._rewrite(await self._timed(plan, self.backend.completion(body)), plan))

    async def compress(self, body: dict, headers) -> dict:
        """What would be sent to the backend for this chat or completion body, without sending it."""
        request = parse_body(ChatCompletionRequest if "messages" in body else CompletionRequest, body)
        options = request_options(headers, request.specprefill, self.settings.keep_rate)
        prompt = self.prompt(request)
        plan = await self.planner.plan(prompt.token_ids, options, request.unsupported_features())
        return {
            "original_tokens": plan.original_tokens,
            "kept_tokens": plan.kept_tokens,
            "keep_rate": plan.keep_rate,
            "status": plan.status,
            "reason": plan.reason,
            "token_ids": plan.kept_token_ids(),
            "position_ids": plan.position_ids(),
        }

    async def _forward_chat(self, plan: Plan, body: dict) -> Answer:
        if body.get("stream"):
            stream = await self._timed(plan, self.backend.chat_stream(body))
            return Answer(plan, stream=self._rewrite_stream(stream, plan))
        return Answer(plan, body=self._rewrite(await self._timed(plan, self.backend.chat(body)), plan))

    @staticmethod
    async def _timed(plan: Plan, call):
        """Awaits a backend call (a stream is opened up to its first event) and records how long it took."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            plan.backend_ms = (time.perf_counter() - start) * 1e3

    # --- answers ---

    def _rewrite(self, body: dict, plan: Plan) -> dict:
        """Our model name, and usage that tells the original and the kept prompt tokens."""
        body["model"] = self.model_name
        usage = body.get("usage")
        if usage:
            completion_tokens = usage.get("completion_tokens", 0)
            usage["prompt_tokens"] = plan.original_tokens
            usage["total_tokens"] = plan.original_tokens + completion_tokens
            usage["specprefill"] = {"original_prompt_tokens": plan.original_tokens,
                                    "kept_prompt_tokens": plan.kept_tokens}
        return body

    async def _rewrite_stream(self, stream: AsyncIterator[dict], plan: Plan) -> AsyncIterator[dict]:
        try:
            async for chunk in stream:
                yield self._rewrite(chunk, plan)
        finally:
            await stream.aclose()


def _passthrough_body(request, backend_model: str) -> dict:
    body = request.model_dump(exclude_unset=True, exclude={"specprefill"})
    body["model"] = backend_model
    return body


def _tokenizer_limit(tokenizer) -> int | None:
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else None

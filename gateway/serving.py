"""The gateway's work: render the prompt, decide, ask the draft, select, forward, and shape the answer.

A request flows one way: router -> policy -> draft -> backend -> answer. Nothing here knows HTTP
routing; the routers in ``app.py`` only parse and choose the response type.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from draft_worker.selector import protected_mask, select_chunks
from gateway.backends import Backend, token_body
from gateway.draft import DraftClient
from gateway.scores import ScoreProvider
from gateway.metrics import GatewayMetrics
from gateway.policy import Reason, RequestOptions, request_options
from gateway.settings import GatewaySettings
from specprefill.chat_format import (
    ChatChunkConverter,
    ChatCompletionRequest,
    CompletionRequest,
    completion_to_chat,
    render_chat,
)
from specprefill.openai_api import InvalidRequestError, NotFoundError, parse_body
from specprefill.streams import as_chat_chunks

logger = logging.getLogger("specprefill.gateway")
DROPPED_MARK = " … "


@dataclass(slots=True)
class Plan:
    """What goes to the backend for one request, and the response headers that say so."""

    token_ids: list[int]
    status: str = "bypassed"
    reason: str | None = None
    kept_indices: list[int] | None = None  # None: the whole prompt
    keep_rate: float = 1.0
    cache: str = "off"
    draft_ms: float = 0.0
    passthrough: bool = False  # forward the client's body unchanged
    tokenize_ms: float = 0.0
    select_ms: float = 0.0
    backend_ms: float = 0.0  # request sent to first answer event received

    @property
    def original_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def kept_tokens(self) -> int:
        return len(self.kept_indices) if self.kept_indices is not None else len(self.token_ids)

    def kept_token_ids(self) -> list[int]:
        if self.kept_indices is None:
            return self.token_ids
        return [self.token_ids[i] for i in self.kept_indices]

    def headers(self) -> dict[str, str]:
        headers = {
            "x-specprefill-status": self.status,
            "x-specprefill-original-tokens": str(self.original_tokens),
            "x-specprefill-kept-tokens": str(self.kept_tokens),
            "x-specprefill-keep-rate": f"{self.keep_rate:g}",
            "x-specprefill-cache": self.cache,
            "x-specprefill-draft-ms": f"{self.draft_ms:.1f}",
        }
        if self.reason:
            headers["x-specprefill-reason"] = self.reason
        headers["server-timing"] = ", ".join(
            f"{name};dur={value:.1f}"
            for name, value in (("tokenize", self.tokenize_ms), ("draft", self.draft_ms),
                                ("select", self.select_ms), ("backend", self.backend_ms))
        )
        return headers


@dataclass(slots=True)
class Answer:
    plan: Plan
    body: dict | None = None
    stream: AsyncIterator[dict] | None = None


class GatewayServing:
    def __init__(self, settings: GatewaySettings, tokenizer, draft: DraftClient, backend: Backend,
                 metrics: GatewayMetrics, served_names: list[str], scores: ScoreProvider) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.draft = draft
        self.scores = scores
        self.backend = backend
        self.metrics = metrics
        self.served_names = served_names
        self._special_ids = set(tokenizer.all_special_ids)

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def check_limits(self, request, token_ids: list[int]) -> None:
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

    # --- planning ---

    async def plan(self, token_ids: list[int], options: RequestOptions, unsupported: list[str]) -> Plan:
        n = len(token_ids)
        self.metrics.original_tokens.observe(n)
        if not options.enabled:
            return Plan(token_ids, reason=Reason.OFF, passthrough=True)
        if unsupported:
            return Plan(token_ids, reason=Reason.unsupported(unsupported[0]), passthrough=True)
        if options.keep_rate >= 1.0:
            return Plan(token_ids, reason=Reason.KEEP_RATE_ONE)
        if n < self.settings.min_prompt_tokens:
            return Plan(token_ids, reason=Reason.SHORT_PROMPT)
        if n > self.draft.max_prompt_tokens:
            return Plan(token_ids, reason=Reason.PROMPT_TOO_LONG)
        start = time.perf_counter()
        try:
            scores, cache = await asyncio.wait_for(self.scores.scores(token_ids), self.settings.draft_timeout)
        except Exception as exc:  # any draft fault: the full prompt goes through instead
            draft_ms = (time.perf_counter() - start) * 1e3
            self.metrics.draft_latency.labels("error").observe(draft_ms / 1e3)
            logger.warning("draft failed, forwarding the full prompt: %s", type(exc).__name__ + (f": {exc}" if str(exc) else ""))
            return Plan(token_ids, reason=Reason.DRAFT_ERROR, draft_ms=draft_ms)
        draft_ms = (time.perf_counter() - start) * 1e3
        if cache != "hit":
            self.metrics.draft_latency.labels("ok").observe(draft_ms / 1e3)
        start = time.perf_counter()
        config = self.draft.config
        special = [i for i, t in enumerate(token_ids) if t in self._special_ids]
        # the last prompt token always goes, so the first generated token sits right after the prompt
        protected = protected_mask(n, config.protect_first, max(config.protect_last, 1), _as_tensor(special))
        kept = select_chunks(scores, options.keep_rate, config.chunk_size, protected).tolist()
        self.metrics.keep_rate.observe(options.keep_rate)
        return Plan(token_ids, status="compressed", kept_indices=kept, keep_rate=options.keep_rate,
                    cache=cache, draft_ms=draft_ms, select_ms=(time.perf_counter() - start) * 1e3)

    def completion_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt's token IDs as the backend would make them (special tokens added, like vLLM)."""
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token IDs must be in [0, {vocab})", param="prompt")
        return list(prompt)

    # --- requests ---

    async def _planned(self, request, headers, tokenize) -> tuple[Plan, list[int], str]:
        """The steps every chat and completion request takes before the backend: checks, tokens, the plan."""
        self.check_model(request.model)
        options = request_options(headers, request.specprefill, self.settings.keep_rate)
        start = time.perf_counter()
        ids = tokenize()
        tokenize_ms = (time.perf_counter() - start) * 1e3
        self.check_limits(request, ids)
        plan = await self.plan(ids, options, request.unsupported_features())
        plan.tokenize_ms = tokenize_ms
        return plan, ids, await self.backend.model_name()

    async def chat(self, request: ChatCompletionRequest, headers) -> Answer:
        if len(request.messages) > self.settings.max_messages:
            raise InvalidRequestError(f"the chat has {len(request.messages)} messages; this gateway accepts at most "
                                      f"{self.settings.max_messages}", param="messages")
        rendered: list[str] = []

        def tokenize() -> list[int]:
            text, ids = render_chat(self.tokenizer, request.messages)
            rendered.append(text)
            return ids

        plan, ids, backend_model = await self._planned(request, headers, tokenize)
        text = rendered[0]
        kind = self.backend.kind
        if plan.passthrough or (kind == "text" and plan.kept_indices is None):
            body = _passthrough_body(request, backend_model)
            return await self._forward_chat(plan, body)
        if kind == "text":
            body = _passthrough_body(request, backend_model)
            body["messages"] = self._kept_messages(request, text, plan)
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
        plan, ids, backend_model = await self._planned(request, headers, lambda: self.completion_ids(request))
        kind = self.backend.kind
        if plan.passthrough or (kind == "text" and plan.kept_indices is None):
            body = _passthrough_body(request, backend_model)
        elif kind == "text":
            body = {"model": backend_model, "prompt": self._kept_text(ids, plan.kept_indices),
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
        if "messages" in body:
            request = parse_body(ChatCompletionRequest, body)
            ids = render_chat(self.tokenizer, request.messages)[1]
        else:
            request = parse_body(CompletionRequest, body)
            ids = self.completion_ids(request)
        options = request_options(headers, request.specprefill, self.settings.keep_rate)
        plan = await self.plan(ids, options, request.unsupported_features())
        kept = plan.kept_indices if plan.kept_indices is not None else list(range(len(ids)))
        return {
            "original_tokens": plan.original_tokens,
            "kept_tokens": plan.kept_tokens,
            "keep_rate": plan.keep_rate,
            "status": plan.status,
            "reason": plan.reason,
            "token_ids": plan.kept_token_ids(),
            "position_ids": kept,
        }

    async def _forward_chat(self, plan: Plan, body: dict) -> Answer:
        if body.get("stream"):
            return Answer(plan, stream=self._rewrite_stream(await self._timed(plan, self.backend.chat_stream(body)), plan))
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

    def _kept_text(self, ids: list[int], kept: list[int]) -> str:
        """Kept tokens as text; each dropped span becomes one mark so the reader sees text was left out."""
        runs, run, last = [], [], None
        for index in kept:
            if last is not None and index != last + 1:
                runs.append(run)
                run = []
            run.append(ids[index])
            last = index
        runs.append(run)
        text = DROPPED_MARK.join(self.tokenizer.decode(r, skip_special_tokens=True) for r in runs if r)
        if kept and kept[0] > 0:
            text = DROPPED_MARK.lstrip() + text
        return text

    def _kept_messages(self, request: ChatCompletionRequest, text: str, plan: Plan) -> list[dict]:
        """Each message's content cut to its kept tokens (the roles and the message list stay)."""
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        kept = set(plan.kept_indices or [])
        messages, cursor = [], 0
        for message in request.messages:
            content = message.text()
            start = text.find(content, cursor) if content else -1
            out = message.model_dump(exclude_none=True)
            if start == -1:  # the template changed the content beyond recognition: keep it whole
                messages.append(out)
                continue
            end = start + len(content)
            cursor = end
            inside = [i for i, (a, _) in enumerate(offsets) if start <= a < end]
            kept_inside = [i for i in inside if i in kept]
            out["content"] = self._kept_text(plan.token_ids, kept_inside) if kept_inside else ""
            if kept_inside == inside:
                out["content"] = content
            messages.append(out)
        return messages


def _passthrough_body(request, backend_model: str) -> dict:
    body = request.model_dump(exclude_unset=True, exclude={"specprefill"})
    body["model"] = backend_model
    return body


def _as_tensor(indices: list[int]) -> torch.Tensor | None:
    return torch.as_tensor(indices, dtype=torch.long) if indices else None


def _tokenizer_limit(tokenizer) -> int | None:
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else None

"""The gateway's work per request: the prologue (checks, tokens, plan), forwarding, and the answer's shape.

A request flows one way: router -> policy -> planner -> backend -> answer. Nothing here knows HTTP
routing; the routers in ``app.py`` only parse and choose the response type.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import torch

from common.chat import ChatChunkConverter, RenderedChat, as_chat_chunks, completion_to_chat, render_chat
from common.errors import APIError, InvalidRequestError, NotFoundError, OverloadedError, parse_body
from common.protocol import ChatCompletionRequest, CompletionRequest
from common.responses import ResponsesRequest
from common.swap import KEPT_KEY, POSITIONS_KEY, SWAP_PARAM
from common.tokenize import PieceCache, token_pieces
from draft_worker.selector import always_kept, select_tokens
from gateway.backends import Backend, token_body
from gateway.draft import DraftClient
from gateway.engine_load import Ticket
from gateway.inspector import KEEP_RATES, inspection, runs
from gateway.metrics import GatewayMetrics
from gateway.plan import Plan
from gateway.planner import Planner
from gateway.policy import Reason, RequestOptions, request_options
from gateway.settings import GatewaySettings
from gateway.text_kind import kept_messages, kept_text
from gateway.warming import Warmer

logger = logging.getLogger("specprefill.gateway")
SYSTEM_ROLES = ("system", "developer")
SWAP_KINDS = ("reference", "vllm")  # backends that render requests themselves and take the swap


@dataclass(slots=True)
class Answer:
    plan: Plan
    body: dict | None = None
    stream: AsyncIterator[dict] | None = None


@dataclass(slots=True)
class Prompt:
    """A request's prompt as the target reads it."""

    token_ids: list[int]
    rendered: RenderedChat | None = None  # a chat's template text and offsets
    keep: torch.Tensor | None = None  # [S] bool: the system prompt, kept whole where affordable
    boundary: int | None = None  # where a chat's last message begins: another user's request leaves this one there


class GatewayServing:
    def __init__(self, settings: GatewaySettings, tokenizer, draft: DraftClient, backend: Backend,
                 metrics: GatewayMetrics, served_names: list[str], planner: Planner,
                 warmer: Warmer | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.draft = draft
        self.backend = backend
        self.metrics = metrics
        self.served_names = served_names
        self.planner = planner
        self.warmer = warmer
        self.load = planner.load  # what the engine is doing: this gateway's requests there, and others'
        self._settling: set[asyncio.Task] = set()  # streams' ends being recorded
        self._mismatch_causes: set[str] = set()  # swap mismatches already logged
        self.pieces = PieceCache(tokenizer)  # chats' repeated parts are tokenized once

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    async def close(self) -> None:
        await asyncio.gather(*self._settling, return_exceptions=True)
        if self.warmer is not None:
            await self.warmer.close()
        await self.load.close()
        await self.backend.close()
        await self.draft.close()
        await self.planner.close()

    # --- the prologue every chat and completion request takes ---

    def prompt(self, request: ChatCompletionRequest | CompletionRequest) -> Prompt:
        """The prompt's tokens as the backend would make them (chat template; special tokens added, like vLLM)."""
        if isinstance(request, ChatCompletionRequest):
            if len(request.messages) > self.settings.max_messages:
                raise InvalidRequestError(f"the chat has {len(request.messages)} messages; this gateway accepts at "
                                          f"most {self.settings.max_messages}", param="messages")
            rendered = render_chat(self.tokenizer, request.messages, self.pieces.encode, tools=request.tools,
                                   add_special_tokens=request.add_special_tokens)
            return Prompt(rendered.token_ids, rendered, self._system_tokens(request, rendered),
                          _last_message_start(request, rendered))
        return Prompt(request.prompt_token_ids(self.tokenizer))

    def _system_tokens(self, request: ChatCompletionRequest, rendered: RenderedChat) -> torch.Tensor | None:
        """The system prompt and the tool definitions (the template's text outside any message), kept whole."""
        has_system = any(m.role in SYSTEM_ROLES for m in request.messages)
        if not self.settings.keep_system_whole or not (has_system or request.tools):
            return None
        keep = np.zeros(len(rendered.token_ids), dtype=bool)
        spans = rendered.content_spans(request.messages)
        for message, span in zip(request.messages, spans):
            if message.role in SYSTEM_ROLES and span is not None:
                keep |= rendered.token_mask(span)
        if request.tools:  # tool definitions are the template's own text, between the message contents
            inside = np.zeros_like(keep)
            for span in spans:
                if span is not None:
                    inside |= rendered.token_mask(span)
            keep |= ~inside
        return torch.from_numpy(keep)

    def check_limits(self, request: ChatCompletionRequest | CompletionRequest, token_ids: list[int]) -> None:
        """The gateway's own limits, before any draft or backend work."""
        settings = self.settings
        limit = prompt_limit(settings, self.tokenizer)
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

    @contextlib.asynccontextmanager
    async def _arrival(self):
        """A client's request, from its arrival until it is at the backend (which then holds it until it is
        answered): the engine's idle gaps are measured between these, and no warming piece starts within one."""
        self.load.enter()
        try:
            yield
        finally:
            self.load.leave()

    async def _planned(self, request: ChatCompletionRequest | CompletionRequest, headers) -> tuple[Plan, Prompt]:
        self.check_model(request.model)
        options = request_options(headers, request.specprefill, self.settings.keep_rate)
        if isinstance(request, ChatCompletionRequest) and not all(m.has_only_text() for m in request.messages):
            return Plan([], reason=Reason.UNSCORED_CONTENT, passthrough=True), Prompt([])  # images, audio
        start = time.perf_counter()
        prompt = self.prompt(request)
        tokenize_ms = (time.perf_counter() - start) * 1e3
        self.check_limits(request, prompt.token_ids)
        plan = await self.planner.plan(prompt.token_ids, options, self._unsupported(request), prompt.keep,
                                       boundary=prompt.boundary)
        plan.tokenize_ms = tokenize_ms
        return plan, prompt

    def _unsupported(self, request: ChatCompletionRequest | CompletionRequest) -> list[str]:
        """What this backend kind cannot reproduce compressed: nothing where the backend renders the request
        itself and takes the swap; a token-ID completion's limits otherwise."""
        return [] if self.backend.kind in SWAP_KINDS else request.unsupported_features()

    # --- requests ---

    async def chat(self, request: ChatCompletionRequest, headers) -> Answer:
        async with self._arrival():
            return await self._chat(request, headers)

    async def completion(self, request: CompletionRequest, headers) -> Answer:
        async with self._arrival():
            return await self._completion(request, headers)

    async def responses(self, request: ResponsesRequest, headers) -> Answer:
        async with self._arrival():
            return await self._responses(request, headers)

    async def _chat(self, request: ChatCompletionRequest, headers) -> Answer:
        plan, prompt = await self._planned(request, headers)
        backend_model = await self.backend.model_name()
        kind = self.backend.kind
        body = _passthrough_body(request, backend_model)
        if kind in SWAP_KINDS or plan.passthrough or plan.kept_indices is None:
            return await self._swapped(plan, body, chat=True)
        if kind == "text":
            body["messages"] = kept_messages(self.tokenizer, request.messages, prompt.rendered, plan.kept_indices)
            return await self._forward(plan, body, chat=True)
        body = token_body(kind, backend_model, plan.kept_token_ids(), plan.kept_indices, request.completion_params())
        return await self._forward(plan, body, chat=False, converter=ChatChunkConverter(self.model_name))

    async def _completion(self, request: CompletionRequest, headers) -> Answer:
        plan, _ = await self._planned(request, headers)
        backend_model = await self.backend.model_name()
        kind = self.backend.kind
        body = _passthrough_body(request, backend_model)
        if kind in SWAP_KINDS or plan.passthrough or plan.kept_indices is None:
            return await self._swapped(plan, body, chat=False)
        if kind == "text":
            body = {"model": backend_model, "prompt": kept_text(self.tokenizer, plan.token_ids, plan.kept_indices),
                    **request.completion_params()}
        else:
            body = token_body(kind, backend_model, plan.kept_token_ids(), plan.kept_indices,
                              request.completion_params())
        return await self._forward(plan, body, chat=False)

    async def _swapped(self, plan: Plan, body: dict, *, chat: bool, endpoint: str | None = None) -> Answer:
        """The client's body to the backend's own endpoint, plus the swap when compressed. A backend that renders
        the prompt differently from the gateway answers the swap with a mismatch 400: the request then goes
        whole, and the client never sees it."""
        if plan.kept_indices is None:
            return await self._forward(plan, body, chat=chat, endpoint=endpoint)
        swap = {KEPT_KEY: plan.kept_token_ids(), POSITIONS_KEY: plan.kept_indices}
        try:
            return await self._forward(plan, {**body, "vllm_xargs": {**(body.get("vllm_xargs") or {}), **swap}},
                                       chat=chat, endpoint=endpoint)
        except APIError as exc:
            if exc.status_code != 400 or exc.param != SWAP_PARAM:
                raise
            self._mismatched(exc.message)
        whole = Plan(plan.token_ids, reason=Reason.SWAP_MISMATCH, cache=plan.cache, draft_ms=plan.draft_ms,
                     tokenize_ms=plan.tokenize_ms)
        return await self._forward(whole, body, chat=chat, endpoint=endpoint)

    def _mismatched(self, message: str) -> None:
        cause = re.sub(r"\d+", "N", message)
        self.metrics.swap_mismatch.labels(cause[:120]).inc()
        if cause not in self._mismatch_causes:
            self._mismatch_causes.add(cause)
            logger.warning("the backend renders prompts differently from the gateway (%s); such requests go whole. "
                           "Check that --target-model has the backend's tokenizer and chat template.", message)

    async def _responses(self, request: ResponsesRequest, headers) -> Answer:
        """OpenAI's Responses API: rendered as the backend renders it (``ResponsesRequest.as_chat``), planned like
        a chat, and the client's own body forwarded to the backend's ``/v1/responses`` with the swap. A request
        the gateway cannot render (reasoning items, a stored previous response), or a backend kind without the
        swap, gets the request whole."""
        body = _passthrough_body(request, await self.backend.model_name())
        try:
            chat = request.as_chat()
        except InvalidRequestError as exc:
            logger.debug("Responses request forwarded whole: %s", exc.message)
            chat = None
        if chat is None or self.backend.kind not in SWAP_KINDS:
            self.check_model(request.model)
            reason = Reason.UNSCORED_CONTENT if chat is None else Reason.unsupported("responses")
            return await self._forward(Plan([], reason=reason, passthrough=True), body, chat=False,
                                       endpoint="/v1/responses")
        chat.specprefill = request.specprefill
        plan, _ = await self._planned(chat, headers)
        return await self._swapped(plan, body, chat=False, endpoint="/v1/responses")

    async def compress(self, body: dict, headers, return_scores: bool = False) -> dict:
        """What would be sent to the backend for this chat or completion body, without sending it; with
        ``return_scores`` (or ``"return_scores": true`` in the body) also the draft's score of every prompt token."""
        return_scores = bool(body.pop("return_scores", False)) or return_scores
        request, options, prompt = self._dry_request(body, headers)
        scored = await self._scores(prompt.token_ids) if return_scores else None
        plan = await self.planner.plan(prompt.token_ids, options, self._unsupported(request), prompt.keep,
                                       boundary=prompt.boundary, dry_run=True, scored=scored)
        answer = {
            "original_tokens": plan.original_tokens,
            "kept_tokens": plan.kept_tokens,
            "keep_rate": plan.keep_rate,
            "status": plan.status,
            "reason": plan.reason,
            "plan": plan.kind,
            "token_ids": plan.kept_token_ids(),
            "position_ids": plan.position_ids(),
        }
        if scored is not None:
            answer["scores"] = [float(s) for s in scored[0].tolist()]
        return answer

    async def inspect(self, body: dict, headers) -> dict:
        """The inspector's data: the prompt's tokens and scores, and the dry-run plan at every keep rate of
        the slider's grid, all from one draft call (``gateway.inspector``)."""
        request, options, prompt = self._dry_request(body, headers)
        unsupported = self._unsupported(request)
        start = time.perf_counter()
        scores, cache = await self._scores(prompt.token_ids)
        draft_ms = (time.perf_counter() - start) * 1e3
        config = self.draft.config
        plans = {}
        for rate in KEEP_RATES:
            plan = await self.planner.plan(prompt.token_ids, RequestOptions(rate, options.enabled), unsupported,
                                           prompt.keep, boundary=prompt.boundary, dry_run=True,
                                           scored=(scores, cache))
            entry = {"status": plan.status, "reason": plan.reason, "plan": plan.kind,
                     "kept": runs(plan.position_ids())}
            if plan.status != "compressed" and rate < 1:  # sent whole: what the rule would have dropped
                entry["selected"] = runs(select_tokens(prompt.token_ids, scores, rate, config,
                                                       self.planner.special_ids, prompt.keep))
            plans[rate] = entry
        protected = always_kept(prompt.token_ids, config, self.planner.special_ids, prompt.keep)
        return inspection(token_pieces(self.tokenizer, prompt.token_ids), scores, protected, config.chunk_size,
                          options.keep_rate, plans, draft_ms=draft_ms, cache=cache, model=self.model_name)

    async def _scores(self, token_ids: list[int]) -> tuple[torch.Tensor, str]:
        """The prompt's scores for a caller that asked for them: a draft fault is a 503 that says so."""
        if len(token_ids) > self.draft.max_prompt_tokens:
            raise InvalidRequestError(f"the prompt has {len(token_ids)} tokens; the draft model scores at most "
                                      f"{self.draft.max_prompt_tokens}", param="prompt", code="prompt_too_long")
        try:
            return await asyncio.wait_for(self.planner.scores.scores(token_ids), self.settings.draft_timeout)
        except Exception as exc:
            raise OverloadedError(f"the draft model could not score this prompt ({type(exc).__name__}); "
                                  "try again later", code="draft_unavailable") from None

    def _dry_request(self, body: dict, headers):
        """A chat or completion body checked as for a real request (the model name may be left out)."""
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object: a chat body with messages, or a completion "
                                      "body with a prompt")
        body = {"model": self.model_name, **body}
        request = parse_body(ChatCompletionRequest if "messages" in body else CompletionRequest, body)
        options = request_options(headers, request.specprefill, self.settings.keep_rate)
        prompt = self.prompt(request)
        self.check_limits(request, prompt.token_ids)
        return request, options, prompt

    async def _forward(self, plan: Plan, body: dict, *, chat: bool, converter: ChatChunkConverter | None = None,
                       endpoint: str | None = None) -> Answer:
        """Sends ``body`` to the backend's chat or completions endpoint (or ``endpoint``, as Responses);
        ``converter`` turns completion answers into chat answers. When it is answered, the planner learns what
        happened."""
        streamed = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) or not streamed
        if streamed and endpoint is None:  # ask for the usage: it says how much the engine served from its cache
            body = {**body, "stream_options": {"include_usage": True}}
        self._foreground(+1)
        # what the engine holds ahead of it now, after the draft (requests planned meanwhile went first)
        wait, predicted, expected = self.load.estimate(plan.target_s)
        plan.wait_ms, plan.predicted_ms = wait * 1e3, predicted * 1e3
        ticket = self.load.begin(plan.target_s, expected_s=expected)
        try:
            if endpoint is not None:
                call = self.backend.stream(endpoint, body) if streamed else self.backend.post(endpoint, body)
            elif streamed:
                call = self.backend.chat_stream(body) if chat else self.backend.completion_stream(body)
            else:
                call = self.backend.chat(body) if chat else self.backend.completion(body)
            answer = await self._timed(plan, call)
        except BaseException:
            self.load.end(ticket)
            self._foreground(-1)
            raise
        plan.background_ms = self.load.answered(ticket) * 1e3
        if ticket.behind:
            self.metrics.behind_background.observe(plan.background_ms / 1e3)
        if streamed:
            stream = self._observed(answer, plan, ticket, wants_usage or endpoint is not None)
            if converter is not None:
                stream = as_chat_chunks(stream, converter)
            return Answer(plan, stream=self._rewrite_stream(stream, plan))
        await self._settle(plan, ticket, answer.get("usage"))
        if converter is not None:
            answer = completion_to_chat(answer, self.model_name)
        return Answer(plan, body=self._rewrite(answer, plan))

    async def _observed(self, chunks: AsyncIterator[dict], plan: Plan, ticket: Ticket,
                        wants_usage: bool) -> AsyncIterator[dict]:
        """The backend's stream, its usage kept for the planner (and hidden from a client that did not ask).
        The stream opened with the backend's first event, so the engine holds the prompt whether or not the
        client reads to the end: the planner learns either way (the usage, if it came, says what was cached)."""
        usage = None
        try:
            async for chunk in chunks:
                usage = chunk.get("usage") or (chunk.get("response") or {}).get("usage") or usage
                if not wants_usage:
                    if not chunk.get("choices"):
                        continue
                    chunk.pop("usage", None)
                yield chunk
        finally:
            # a task: a client's disconnect cancels this generator, and an await here would be cancelled too
            task = asyncio.ensure_future(self._settle(plan, ticket, usage, chunks))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _settle(self, plan: Plan, ticket: Ticket, usage: dict | None,
                      chunks: AsyncIterator[dict] | None = None) -> None:
        """The end of a backend request: the stream closed (the backend stops generating for a client that
        left), the planner told, and a recurring context offered for warming. The request counts as under way
        until then, so that no one watching sees the backend idle in between."""
        try:
            if chunks is not None:
                await chunks.aclose()
            await self._answered(plan, usage, ticket.contended)
        finally:
            self.load.end(ticket)
            self._foreground(-1)

    async def _answered(self, plan: Plan, usage: dict | None, contended: bool) -> None:
        """The planner learns from an answered request; a compressed recurring context is offered for warming."""
        try:
            await self.planner.completed(plan, usage, plan.backend_ms / 1e3, contended=contended)
        except Exception:  # learning is best effort: never an error for the client
            logger.exception("could not record the plan's outcome")
        if self.warmer is not None and plan.status == "compressed" and plan.recurring:
            self.warmer.offer(plan)

    def _foreground(self, delta: int) -> None:
        """A request of this gateway at the backend (+1) or done there (-1)."""
        if delta > 0:
            self.load.enter()
        else:
            self.load.leave()
        self.metrics.in_flight.labels("foreground").inc(delta)

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
        """Our model name, and usage that tells the original and the kept prompt tokens (a Response's too)."""
        if isinstance(body.get("response"), dict):  # a Responses stream event
            self._rewrite(body["response"], plan)
            return body
        if "model" in body:
            body["model"] = self.model_name
        usage = body.get("usage")
        if usage:
            responses = "input_tokens" in usage
            completion_tokens = usage.get("output_tokens" if responses else "completion_tokens", 0)
            usage["input_tokens" if responses else "prompt_tokens"] = plan.original_tokens
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


def _last_message_start(request: ChatCompletionRequest, rendered: RenderedChat) -> int | None:
    """The first token of the chat's last message content (None where the template changed it)."""
    span = rendered.content_spans(request.messages)[-1] if request.messages else None
    if span is None:
        return None
    return int(np.searchsorted(rendered.offsets[:, 0], span[0]))


def prompt_limit(settings: GatewaySettings, tokenizer) -> int | None:
    """The longest prompt this gateway takes: ``--max-prompt-tokens``, else the target tokenizer's limit."""
    return settings.max_prompt_tokens or _tokenizer_limit(tokenizer)


def _tokenizer_limit(tokenizer) -> int | None:
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else None

"""The path every API surface shares, in one entry (``GatewayServing.serve``): a surface's request, converted to the
chat or completion the target reads, goes through checks, tokens and the plan, then reaches the backend one of
three ways (the client's body with the swap, the kept messages, or the kept tokens at their positions as a
completion), and the whole prompt where the backend refuses the swap. ``gateway.dispatch`` takes the plan to a
replica and learns from the answer.

A request flows one way: router -> API surface (``gateway/entrypoints``: chat, completions, Responses,
Messages, each converting its request to a chat or completion and its answers back) -> policy -> planner ->
dispatch -> backend -> answer -> feedback. Nothing here knows HTTP routing or an API's answer shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from common.chat import (
    ChatChunkConverter,
    RenderedChat,
    as_chat_chunks,
    chat_text,
    completion_to_chat,
    render_chat,
)
from common.errors import APIError, InvalidRequestError, NotFoundError, OverloadedError
from common.prompt_bound import refuse_unfittable
from common.protocol import ChatCompletionRequest, CompletionRequest, WireModel
from common.swap import KEPT_KEY, POSITIONS_KEY, SWAP_PARAM
from common.tokenize import PieceCache
from gateway.dispatch.answer import CHAT, COMPLETIONS, Answer, Endpoint
from gateway.dispatch.dispatcher import Dispatcher
from gateway.engines.backends import Backend, StreamRefused
from gateway.engines.kinds import Kept
from gateway.engines.replicas import HealthWatch
from gateway.metrics import GatewayMetrics
from gateway.planning.draft import DraftClient
from gateway.planning.plan import Plan
from gateway.planning.planner import Planner
from gateway.planning.policy import Reason, RequestOptions, request_options
from gateway.planning.prompt import Prompt
from gateway.planning.routing import Router
from gateway.settings import GatewaySettings

logger = logging.getLogger("specprefill.gateway")
SYSTEM_ROLES = ("system", "developer")
OFF_LOOP_CHARS = 65536  # prompts longer than this are rendered and tokenized off the event loop (about 20 ms)
# a request sent before its plan is made gains where the engine takes longer than the plan to its first event:
# measured against planning first (gateway_overhead.py, 100 words, 2 AMD EPYC cores), -0.53 ms where the backend
# takes 2 ms more than one that answers at once, -0.37 ms at 5 ms more, and +0.35 ms on the one that answers at once
OVERLAP_FROM_S = 0.002


@dataclass(frozen=True, slots=True)
class Converted:
    """A surface's request as the shared path takes it: ``request``, the chat or completion the target reads
    (None: one the gateway cannot render, sent whole for ``unplanned``'s reason), and the client's own request,
    ``wire``, which goes to the backend's ``endpoint`` (its model's name set, then ``adjust``ed to the plan).
    A backend without the swap takes only chats and completions: another surface's chat is served as a chat there
    and its answer converted by ``from_chat``, or, without one, the client's body goes whole."""

    request: ChatCompletionRequest | CompletionRequest | None
    wire: WireModel
    endpoint: Endpoint
    adjust: Callable[[dict[str, Any]], None] | None = None
    unplanned: str | None = None  # why ``request`` is None (``Reason``)
    from_chat: Callable[[Answer], Answer] | None = None


class GatewayServing:
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: PreTrainedTokenizerBase,
        draft: DraftClient,
        metrics: GatewayMetrics,
        served_names: list[str],
        planner: Planner,
        health: HealthWatch | None = None,
        context: int | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.draft = draft
        self.metrics = metrics
        self.served_names = served_names
        self.planner = planner
        # the engines, each with its backend, its cache model and KV events, its load and its warming
        self.replicas = planner.replicas
        self.backend: Backend = self.replicas[0].backend  # the first: what every replica is (kind, model name)
        self.health = health
        self.router = Router(planner)
        self.dispatch = Dispatcher(planner, self.router, metrics)
        self._mismatch_causes: set[str] = set()  # swap mismatches already logged
        self.pieces = PieceCache(tokenizer)  # chats' repeated parts are tokenized once
        self.context = context  # the target's positions: a prompt's tokens and its answer's (None: not known)

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    async def close(self) -> None:
        await self.dispatch.close()
        if self.health is not None:
            await self.health.close()
        for replica in self.replicas:
            await replica.close()
        await self.draft.close()
        await self.planner.close()

    # --- the one path every request takes ---

    async def serve(self, converted: Converted, headers: Mapping[str, str]) -> Answer:
        """A converted request in, the backend's answer out (in the shape of ``converted.endpoint``): rendered
        and planned, its body made, and dispatched the one way the plan and the backend kind allow."""
        request, endpoint = converted.request, converted.endpoint
        if request is not None and not self.swaps and endpoint not in (CHAT, COMPLETIONS):
            if converted.from_chat is not None and isinstance(request, ChatCompletionRequest):
                return converted.from_chat(await self.serve(Converted(request, request, CHAT), headers))
            request = None  # no chat path back to this surface's answers: the client's body, whole
            converted = replace(converted, unplanned=Reason.unsupported(endpoint.path.rsplit("/", 1)[-1]))
        if request is None:  # nothing the gateway can render (or send compressed): the client's body, whole
            self.check_model(getattr(converted.wire, "model", ""))
            plan = Plan([], reason=converted.unplanned or Reason.UNSCORED_CONTENT, passthrough=True)
            return await self.forward(plan, await self.backend_body(converted.wire), endpoint)
        options, chars = self.checked(request, headers)
        first, text = self._sends_first(request, options, chars)
        if first:  # sent before its tokens and plan are made: they are made while the backend reads the prompt
            body = await self.backend_body(converted.wire)
            if converted.adjust is not None:
                converted.adjust(body)
            planning = functools.partial(self.planned, request, options, chars, text)
            return await self.dispatch.forward(self._sent_first, body, endpoint, planning=planning)
        plan, prompt = await self.planned(request, options, chars, text)
        body = await self.backend_body(converted.wire)
        if converted.adjust is not None:
            converted.adjust(body)
        if self.swaps or plan.passthrough or plan.position_ids is None:
            return await self.swapped(plan, body, endpoint)
        messages = request.messages if isinstance(request, ChatCompletionRequest) else None
        kept = Kept(plan.token_ids, plan.position_ids, request.completion_params(), messages, prompt.rendered)
        return await self.kept(plan, kept, body)

    async def kept(self, plan: Plan, kept: Kept, body: dict[str, Any]) -> Answer:
        """A compressed prompt to a backend without the swap, as its kind takes it (``Kind.kept_body``): the kept
        messages to its chat endpoint, or the kept tokens as a completion, whose answers a chat gets as chat."""
        body, as_chat = self.backend.kind.kept_body(body, kept, self.tokenizer)
        answer = await self.forward(plan, body, CHAT if as_chat else COMPLETIONS)
        if as_chat or kept.messages is None:
            return answer
        model = self.model_name
        return answer.map(
            lambda b: completion_to_chat(b, model), lambda s: as_chat_chunks(s, ChatChunkConverter(model))
        )

    # --- its prologue: checks, tokens and the plan ---

    def prompt(self, request: ChatCompletionRequest | CompletionRequest, text: str | None = None) -> Prompt:
        """The prompt's tokens as the backend would make them (chat template; special tokens added, like vLLM).
        ``text``: the chat's ``chat_text``, where it was written already."""
        if isinstance(request, ChatCompletionRequest):
            self._check_messages(request)
            rendered = render_chat(
                self.tokenizer,
                request.messages,
                self.pieces.encode_arrays,
                tools=request.tools,
                add_special_tokens=request.add_special_tokens,
                text=text,
            )
            return Prompt(
                rendered.token_ids,
                rendered,
                self._system_tokens(request, rendered),
                _last_message_start(request, rendered),
            )
        return Prompt(request.prompt_token_ids(self.tokenizer))

    def _check_messages(self, request: ChatCompletionRequest) -> None:
        if len(request.messages) > self.settings.max_messages:
            raise InvalidRequestError(
                f"the chat has {len(request.messages)} messages; this gateway accepts at "
                f"most {self.settings.max_messages}",
                param="messages",
            )

    def _system_tokens(self, request: ChatCompletionRequest, rendered: RenderedChat) -> torch.Tensor | None:
        """The system prompt and the tool definitions (the template's text outside any message), kept whole."""
        has_system = any(m.role in SYSTEM_ROLES for m in request.messages)
        if not self.settings.keep_system_whole or not (has_system or request.tools):
            return None
        keep = np.zeros(len(rendered.token_ids), dtype=bool)
        spans = rendered.content_spans(request.messages)
        for message, span in zip(request.messages, spans):
            if message.role in SYSTEM_ROLES and span is not None:
                rendered.mark(keep, span)
        if request.tools:  # tool definitions are the template's own text, between the message contents
            inside = np.zeros_like(keep)
            for span in spans:
                if span is not None:
                    rendered.mark(inside, span)
            keep |= ~inside
        return torch.from_numpy(keep)

    def check_limits(self, request: ChatCompletionRequest | CompletionRequest, token_ids: list[int]) -> None:
        """The gateway's own limits, before any draft or backend work."""
        settings = self.settings
        limit = prompt_limit(settings, self.tokenizer)
        if limit is not None and len(token_ids) > limit:
            param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; this gateway accepts at most {limit}",
                param=param,
                code="context_length_exceeded",
            )
        requested = request.completion_params().get("max_tokens")
        if requested is not None and settings.max_tokens_limit is not None and requested > settings.max_tokens_limit:
            raise InvalidRequestError(
                f"max_tokens is {requested}; this gateway allows at most {settings.max_tokens_limit}",
                param="max_tokens",
            )

    def admit(self) -> None:
        """Load shed: a 503 with ``Retry-After`` at once where every replica's queue would hold this request past
        ``--max-queue-wait`` (the wait the planner prices plans with), before any tokenizing or draft work."""
        limit = self.settings.max_queue_wait
        if limit is None:
            return
        wait = (
            min(replica.load.wait_s() for replica in self.replicas if replica.up)
            if any(replica.up for replica in self.replicas)
            else 0.0
        )
        if wait > limit:
            self.metrics.shed.inc()
            retry = max(1, math.ceil(wait - limit))
            raise OverloadedError(
                f"the engine is busy: a request sent now would wait about {wait:.0f} s before "
                f"it starts, over this gateway's {limit:g} s (--max-queue-wait); retry in "
                f"{retry} s",
                code="queue_full",
                headers={"retry-after": str(retry)},
            )

    def check_model(self, model: str) -> None:
        if model not in self.served_names:
            also = [repr(n) for n in self.served_names[1:]]
            raise NotFoundError(
                f"model {model!r} does not exist; this gateway serves {self.model_name!r}"
                + (f" (also as {', '.join(also)})" if also else "")
                + f": send one of those, or start the gateway with --model-alias {model} to serve it as {model!r} too",
                param="model",
                code="model_not_found",
            )

    @contextlib.asynccontextmanager
    async def arrival(self) -> AsyncIterator[None]:
        """A client's request, from its arrival until it is at the backend (which then holds it until it is
        answered): the engines' idle gaps are measured between these, and no warming piece starts within one (it
        may go to any replica)."""
        for replica in self.replicas:
            replica.load.enter()
        try:
            yield
        finally:
            for replica in self.replicas:
                replica.load.leave()

    def checked(
        self, request: ChatCompletionRequest | CompletionRequest, headers: Mapping[str, str]
    ) -> tuple[RequestOptions, int | None]:
        """The checks that need no tokens (the model's name, the options, the bound on the prompt's length, the
        room for the answer) and admission; the request's options and its characters (None: content the draft
        cannot read, such as images, which goes whole unplanned)."""
        self.check_model(request.model)
        options = request_options(headers, request.specprefill, self.settings.default_keep_rate)
        unscored = isinstance(request, ChatCompletionRequest) and not all(m.has_only_text() for m in request.messages)
        # a request that can never fit is the client's to change, busy engine or not: its 400 before any 503
        chars = (
            None
            if unscored
            else refuse_unfittable(request, self.tokenizer, prompt_limit(self.settings, self.tokenizer))
        )
        output, requested = request.output_limit, request.completion_params().get("max_tokens")
        output.never_fits(requested, self.context)
        self.admit()
        return options, chars

    async def planned(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        options: RequestOptions,
        chars: int | None,
        text: str | None = None,
    ) -> tuple[Plan, Prompt]:
        """The checked request tokenized as the target reads it (from ``text``, its chat's text, where written
        already), and planned."""
        if chars is None:
            return Plan([], reason=Reason.UNSCORED_CONTENT, passthrough=True), Prompt([])  # images, audio
        start = time.perf_counter()
        # a long prompt is rendered and tokenized on a worker thread: other requests and /health go on meanwhile
        if chars > OFF_LOOP_CHARS:
            prompt = await asyncio.to_thread(self.prompt, request, text)
        else:
            prompt = self.prompt(request, text)
        tokenize_ms = (time.perf_counter() - start) * 1e3
        self.check_limits(request, prompt.token_ids)
        # the room counts the whole prompt's positions, compressed or not: generation continues after the last
        output, requested = request.output_limit, request.completion_params().get("max_tokens")
        if (fitted := output.fit(requested, len(prompt.token_ids), self.context)) != requested and fitted:
            request.lower_max_tokens(fitted)
        plan = await self.plan(prompt, options, self.unsupported(request))
        return plan.but(tokenize_ms=tokenize_ms), prompt

    def _sends_first(
        self, request: ChatCompletionRequest | CompletionRequest, options: RequestOptions, chars: int | None
    ) -> tuple[bool, str | None]:
        """Whether the request goes whole whatever its tokens, so that it can be sent before they are made
        (``--plan-after-send``), and the chat's text where it was written to find out (for its tokens). A
        byte-level tokenizer makes at most one token of each byte of the text, so a chat whose text has fewer
        bytes than ``--min-prompt-tokens`` is a short prompt (a text the bound misjudges, such as one that
        Unicode normalization lengthens, is still sent whole: only a compression is missed). Only where the
        engine's recent requests took it ``OVERLAP_FROM_S`` or more to their first event (the plan's work is then
        hidden; against an engine that answers at once, planning first is faster), with one replica (several
        are chosen by their caches, from the tokens), and where nothing of the request changes with its length:
        under the prompt limit, its answer's room as asked."""
        typical = self.replicas[0].load.typical_s()
        if (
            not self.settings.plan_after_send
            or typical is None
            or typical < OVERLAP_FROM_S
            or chars is None
            or chars > OFF_LOOP_CHARS
            or len(self.replicas) != 1
            or not isinstance(request, ChatCompletionRequest)
            or request.add_special_tokens
            or len(request.messages) > self.settings.max_messages
        ):
            return False, None
        unsupported = self.unsupported(request)
        if not self.planner.whole_for_any(chars, options, unsupported):  # its text has at least as many bytes
            return False, None
        text = chat_text(self.tokenizer, request.messages, request.tools)
        most = len(text.encode())
        limit = prompt_limit(self.settings, self.tokenizer)
        requested, context = request.completion_params().get("max_tokens"), self.context
        room = requested is None or context is None or requested + most <= context
        fits = (limit is None or most <= limit) and room
        return fits and self.planner.whole_for_any(most, options, unsupported), text

    @property
    def _sent_first(self) -> Plan:
        """What the dispatcher holds of a request sent before its plan is made: the one replica."""
        return Plan([], replica=self.replicas[0])

    async def plan(
        self,
        prompt: Prompt,
        options: RequestOptions,
        unsupported: list[str],
        *,
        dry_run: bool = False,
        scored: tuple[torch.Tensor, str] | None = None,
    ) -> Plan:
        """The prompt routed to a replica (``gateway.planning.routing``) and planned there."""
        tokens = prompt.token_array()
        replica, whole = await self.router.route(tokens, options, prompt.keep, dry_run=dry_run)
        return await self.planner.plan(
            prompt, options, unsupported, dry_run=dry_run, scored=scored, replica=replica, whole=whole
        )

    def unsupported(self, request: ChatCompletionRequest | CompletionRequest) -> list[str]:
        """What this backend kind cannot reproduce compressed: nothing where the backend renders the request
        itself and takes the swap; a token-ID completion's limits otherwise."""
        return [] if self.swaps else request.unsupported_features()

    @property
    def swaps(self) -> bool:
        """Whether the backend renders requests itself and takes the swap on its own endpoints."""
        return self.backend.kind.takes_swap

    async def backend_body(self, request: WireModel) -> dict[str, Any]:
        """The client's request as the backend's own endpoint takes it: unchanged but for the model's name."""
        body: dict[str, Any] = request.model_dump(exclude_unset=True, exclude={"specprefill"})
        body["model"] = await self.backend.model_name()
        return body

    async def swapped(self, plan: Plan, body: dict[str, Any], endpoint: Endpoint) -> Answer:
        """The client's body to the backend's own endpoint, plus the swap when compressed. A backend that renders
        the prompt differently from the gateway answers the swap with a mismatch 400: the request then goes
        whole, and the client never sees it."""
        if plan.position_ids is None:
            return await self.forward(plan, body, endpoint)
        # lists, as JSON has them: an in-process backend reads the body as it is, and the swap's check wants lists
        swap = {KEPT_KEY: list(plan.kept_token_ids()), POSITIONS_KEY: list(plan.position_ids)}
        try:
            return await self.forward(
                plan, {**body, "vllm_xargs": {**(body.get("vllm_xargs") or {}), **swap}}, endpoint
            )
        except StreamRefused as exc:  # refused after its 200, before any content: the whole prompt, as a mismatch
            self._mismatched(exc.message)
        except APIError as exc:
            if exc.status_code != 400 or exc.param != SWAP_PARAM:
                raise
            self._mismatched(exc.message)
        whole = Plan(
            plan.token_ids,
            reason=Reason.SWAP_MISMATCH,
            cache=plan.cache,
            draft_ms=plan.draft_ms,
            tokenize_ms=plan.tokenize_ms,
            replica=plan.replica,
            tokens=plan.tokens,
        )
        return await self.forward(await self.planner.priced(whole), body, endpoint)

    def _mismatched(self, message: str) -> None:
        cause = re.sub(r"\d+", "N", message)
        self.metrics.swap_mismatch.labels(cause[:120]).inc()
        if cause not in self._mismatch_causes:
            self._mismatch_causes.add(cause)
            logger.warning(
                "the backend renders prompts differently from the gateway (%s); such requests go whole. "
                "Check that --target-model has the backend's tokenizer and chat template.",
                message,
            )

    def warms_next_turn(self, plan: Plan) -> bool:
        """Whether the start of the client's next turn is to be warmed behind ``plan``'s answer."""
        return self.dispatch.feedback.warms(plan)

    def next_turn(self, plan: Plan, chat: Callable[[], ChatCompletionRequest]) -> None:
        """``plan``'s answer is in: the client's next turn (``chat()``, rendered up to where its next message's
        text begins) is offered for warming."""

        def render() -> list[int] | None:
            prompt = self.prompt(chat())
            return None if prompt.boundary is None else prompt.token_ids[: prompt.boundary]

        self.dispatch.feedback.next_turn(plan, render)

    async def forward(self, plan: Plan, body: dict[str, Any], endpoint: Endpoint) -> Answer:
        """``body`` to the backend's ``endpoint`` (``Dispatcher.forward``)."""
        return await self.dispatch.forward(plan, body, endpoint)


def _last_message_start(request: ChatCompletionRequest, rendered: RenderedChat) -> int | None:
    """The first token of the chat's last message content (None where the template changed it)."""
    span = rendered.content_spans(request.messages)[-1] if request.messages else None
    if span is None:
        return None
    return int(np.searchsorted(rendered.offsets[:, 0], span[0]))


def prompt_limit(settings: GatewaySettings, tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The longest prompt this gateway takes: ``--max-prompt-tokens``, else the target tokenizer's limit."""
    return settings.max_prompt_tokens or _tokenizer_limit(tokenizer)


def _tokenizer_limit(tokenizer: PreTrainedTokenizerBase) -> int | None:
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else None

"""The path every API surface shares: the prologue (checks, tokens, plan), forwarding, and learning from the answer.

A request flows one way: router -> API surface (``gateway/entrypoints``: chat, completions, Responses,
Messages, each converting its request to a chat or completion and its answers back) -> policy -> planner ->
backend -> answer. Nothing here knows HTTP routing or an API's answer shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.chat import RenderedChat, render_chat
from common.errors import APIError, InvalidRequestError, NotFoundError, OverloadedError
from common.prompt_bound import refuse_unfittable
from common.protocol import ChatCompletionRequest, CompletionRequest
from common.swap import KEPT_KEY, POSITIONS_KEY, SWAP_PARAM
from common.tokenize import PieceCache
from gateway.backends import Backend, BackendGone, StreamRefused
from gateway.draft import DraftClient
from gateway.engine_load import Ticket
from gateway.metrics import GatewayMetrics
from gateway.plan import Plan
from gateway.planner import Planner
from gateway.policy import Reason, request_options
from gateway.replicas import HealthWatch, Replica
from gateway.settings import GatewaySettings

logger = logging.getLogger("specprefill.gateway")
SYSTEM_ROLES = ("system", "developer")
OFF_LOOP_CHARS = 65536  # prompts longer than this are rendered and tokenized off the event loop (about 20 ms)
CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"


@dataclass(slots=True)
class Answer:
    plan: Plan
    body: dict | None = None
    stream: AsyncIterator[dict] | None = None

    def map(self, body: Callable[[dict], dict], stream: Callable[[AsyncIterator[dict]], AsyncIterator[dict]]) -> Answer:
        """This answer in another shape: ``body`` for a whole one, ``stream`` for a streamed one."""
        if self.stream is not None:
            return Answer(self.plan, stream=stream(self.stream))
        return Answer(self.plan, body=body(self.body))


@dataclass(slots=True)
class Prompt:
    """A request's prompt as the target reads it."""

    token_ids: list[int]
    rendered: RenderedChat | None = None  # a chat's template text and offsets
    keep: torch.Tensor | None = None  # [S] bool: the system prompt, kept whole where affordable
    boundary: int | None = None  # where a chat's last message begins: another user's request leaves this one there


class GatewayServing:
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer,
        draft: DraftClient,
        metrics: GatewayMetrics,
        served_names: list[str],
        planner: Planner,
        health: HealthWatch | None = None,
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
        self._settling: set[asyncio.Task] = set()  # streams' ends being recorded
        self._mismatch_causes: set[str] = set()  # swap mismatches already logged
        self.pieces = PieceCache(tokenizer)  # chats' repeated parts are tokenized once

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    async def close(self) -> None:
        await asyncio.gather(*self._settling, return_exceptions=True)
        if self.health is not None:
            await self.health.close()
        for replica in self.replicas:
            await replica.close()
        await self.draft.close()
        await self.planner.close()

    # --- the prologue every chat and completion request takes ---

    def prompt(self, request: ChatCompletionRequest | CompletionRequest) -> Prompt:
        """The prompt's tokens as the backend would make them (chat template; special tokens added, like vLLM)."""
        if isinstance(request, ChatCompletionRequest):
            if len(request.messages) > self.settings.max_messages:
                raise InvalidRequestError(
                    f"the chat has {len(request.messages)} messages; this gateway accepts at "
                    f"most {self.settings.max_messages}",
                    param="messages",
                )
            rendered = render_chat(
                self.tokenizer,
                request.messages,
                self.pieces.encode,
                tools=request.tools,
                add_special_tokens=request.add_special_tokens,
            )
            return Prompt(
                rendered.token_ids,
                rendered,
                self._system_tokens(request, rendered),
                _last_message_start(request, rendered),
            )
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
            raise NotFoundError(
                f"model {model!r} does not exist; this gateway serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @contextlib.asynccontextmanager
    async def arrival(self):
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

    async def planned(self, request: ChatCompletionRequest | CompletionRequest, headers) -> tuple[Plan, Prompt]:
        """The request checked, tokenized as the target reads it, and planned."""
        self.check_model(request.model)
        self.admit()
        options = request_options(headers, request.specprefill, self.settings.keep_rate)
        if isinstance(request, ChatCompletionRequest) and not all(m.has_only_text() for m in request.messages):
            return Plan([], reason=Reason.UNSCORED_CONTENT, passthrough=True), Prompt([])  # images, audio
        chars = refuse_unfittable(request, self.tokenizer, prompt_limit(self.settings, self.tokenizer))
        start = time.perf_counter()
        # a long prompt is rendered and tokenized on a worker thread: other requests and /health go on meanwhile
        prompt = await asyncio.to_thread(self.prompt, request) if chars > OFF_LOOP_CHARS else self.prompt(request)
        tokenize_ms = (time.perf_counter() - start) * 1e3
        self.check_limits(request, prompt.token_ids)
        plan = await self.planner.plan(
            prompt.token_ids, options, self.unsupported(request), prompt.keep, boundary=prompt.boundary
        )
        plan.tokenize_ms = tokenize_ms
        return plan, prompt

    def unsupported(self, request: ChatCompletionRequest | CompletionRequest) -> list[str]:
        """What this backend kind cannot reproduce compressed: nothing where the backend renders the request
        itself and takes the swap; a token-ID completion's limits otherwise."""
        return [] if self.swaps else request.unsupported_features()

    @property
    def swaps(self) -> bool:
        """Whether the backend renders requests itself and takes the swap on its own endpoints."""
        return self.backend.kind.takes_swap

    async def backend_body(self, request) -> dict:
        """The client's request as the backend's own endpoint takes it: unchanged but for the model's name."""
        body = request.model_dump(exclude_unset=True, exclude={"specprefill"})
        body["model"] = await self.backend.model_name()
        return body

    async def swapped(self, plan: Plan, body: dict, path: str) -> Answer:
        """The client's body to the backend's own endpoint, plus the swap when compressed. A backend that renders
        the prompt differently from the gateway answers the swap with a mismatch 400: the request then goes
        whole, and the client never sees it."""
        if plan.kept_indices is None:
            return await self.forward(plan, body, path)
        swap = {KEPT_KEY: plan.kept_token_ids(), POSITIONS_KEY: plan.kept_indices}
        try:
            return await self.forward(plan, {**body, "vllm_xargs": {**(body.get("vllm_xargs") or {}), **swap}}, path)
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
        )
        await self.planner.priced(whole)
        return await self.forward(whole, body, path)

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

    async def forward(self, plan: Plan, body: dict, path: str) -> Answer:
        """Sends ``body`` to the backend's endpoint ``path`` at the plan's replica; the answer as the backend gave
        it (the API surface shapes it for its client). When it is answered, the planner learns what happened.
        A replica that drops the request before its first event (refused, or gone mid-prefill: the client has
        seen nothing) is taken out, and the request goes to another."""
        streamed = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage")) or not streamed
        if streamed and path in (CHAT, COMPLETIONS):  # ask for the usage: it says what the engine's cache served
            body = {**body, "stream_options": {"include_usage": True}}
        plan.replica = plan.replica or min(self.replicas, key=lambda r: (not r.up, r.load.outstanding))
        tried = set()
        while True:
            replica = plan.replica
            tried.add(replica)
            try:
                answer, ticket = await self._sent(plan, replica, path, body, streamed)
                break
            except BackendGone as exc:
                others = [r for r in self.replicas if r.up and r not in tried]
                if not others:
                    raise
                replica.down(exc.message)
                self.metrics.failovers.inc()
                plan.replica = min(others, key=lambda r: r.load.outstanding)
                await self.planner.priced(plan)
        if ticket.behind:
            self.metrics.behind_background.observe(plan.background_ms / 1e3)
        if streamed:
            return Answer(
                plan, stream=self._observed(answer, plan, ticket, wants_usage or path not in (CHAT, COMPLETIONS))
            )
        await self._settle(plan, ticket, answer.get("usage"))
        return Answer(plan, body=answer)

    async def _sent(self, plan: Plan, replica: Replica, path: str, body: dict, streamed: bool):
        """``body`` at ``replica``, up to its first event: the answer (a stream is open) and its load ticket."""
        load = replica.load
        self.metrics.routed.labels(str(replica.index)).inc()
        self._foreground(load, +1)
        # what the engine holds ahead of it now, after the draft (requests planned meanwhile went first)
        wait, predicted, expected = load.estimate(plan.target_s)
        plan.wait_ms, plan.predicted_ms = wait * 1e3, predicted * 1e3
        ticket = load.begin(plan.target_s, expected_s=expected)
        try:
            answer = await self._timed(plan, self._call(replica.backend, path, body, streamed))
        except BaseException:
            load.end(ticket)
            self._foreground(load, -1)
            raise
        plan.background_ms = load.answered(ticket) * 1e3
        return answer, ticket

    @staticmethod
    def _call(backend: Backend, path: str, body: dict, streamed: bool):
        if path == CHAT:
            return backend.chat_stream(body) if streamed else backend.chat(body)
        if path == COMPLETIONS:
            return backend.completion_stream(body) if streamed else backend.completion(body)
        return backend.stream(path, body) if streamed else backend.post(path, body)

    async def _observed(
        self, chunks: AsyncIterator[dict], plan: Plan, ticket: Ticket, wants_usage: bool
    ) -> AsyncIterator[dict]:
        """The backend's stream, its usage kept for the planner (and hidden from a client that did not ask).
        The stream opened with the backend's first event, so the engine holds the prompt whether or not the
        client reads to the end: the planner learns either way (the usage, if it came, says what was cached)."""
        usage = None
        try:
            async for chunk in chunks:
                # chat and completion chunks; a Responses event's response; an Anthropic message_start's message
                usage = (
                    chunk.get("usage") or (chunk.get("response") or chunk.get("message") or {}).get("usage") or usage
                )
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

    async def _settle(
        self, plan: Plan, ticket: Ticket, usage: dict | None, chunks: AsyncIterator[dict] | None = None
    ) -> None:
        """The end of a backend request: the stream closed (the backend stops generating for a client that
        left), the planner told, and a recurring context offered for warming. The request counts as under way
        until then, so that no one watching sees the backend idle in between."""
        try:
            if chunks is not None:
                await chunks.aclose()
            await self._answered(plan, usage, ticket.contended)
        finally:
            plan.replica.load.end(ticket)
            self._foreground(plan.replica.load, -1)

    async def _answered(self, plan: Plan, usage: dict | None, contended: bool) -> None:
        """The planner learns from an answered request; a compressed recurring context is offered for warming."""
        try:
            await self.planner.completed(plan, usage, plan.backend_ms / 1e3, contended=contended)
        except Exception:  # learning is best effort: never an error for the client
            logger.exception("could not record the plan's outcome")
        warmer = plan.replica.warmer
        if warmer is not None and plan.status == "compressed" and plan.recurring:
            warmer.offer(plan)

    def _foreground(self, load, delta: int) -> None:
        """A request of this gateway at a replica (+1) or done there (-1)."""
        if delta > 0:
            load.enter()
        else:
            load.leave()
        self.metrics.in_flight.labels("foreground").inc(delta)

    @staticmethod
    async def _timed(plan: Plan, call):
        """Awaits a backend call (a stream is opened up to its first event) and records how long it took."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            plan.backend_ms = (time.perf_counter() - start) * 1e3


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

"""The planner: what goes to the backend for one request, priced against what the engine already holds.

Candidates:
  whole   the prompt as it is.
  fresh   SpecPrefill's selection at the keep rate (``select_tokens``; system prompts kept whole unless that
          costs far more than compressing them, as for a long system prompt the engine has not seen yet).
  extend  an earlier compressed request's kept tokens below the point where its prompt and this one part,
          then the selection rule on the rest: the engine's prefix cache serves the reused run. Allowed only
          when the earlier selection keeps at least ``reuse_threshold`` of the importance that a fresh
          selection keeps there (by the draft's scores for *this* prompt), and at a keep rate no lower.
Each is priced by the calibrated cost models: draft time on what the draft has not seen, plus target time on
what the engine has not cached. The plan that keeps more of the prompt (whole, then fresh, then extend) wins
while it costs at most ``plan_slack`` more than the cheapest. Before the draft runs, the whole prompt is
priced against the least any compression could cost; when it is cheaper even so (a short or mostly cached
prompt, a slow draft), the draft is skipped (reason ``cheaper_whole``).

Where the request goes among several replicas is ``gateway.planning.routing``'s; a plan is priced at one replica.

Prices are for the engine as it is now (``EngineLoad``): a request waits for the prefill left of those ahead of
it, and the draft runs during that wait, so a busy engine makes the draft cost less (only what outlasts the
wait). The cost models learn only from timings that nothing else shared the engine with: a burst of traffic,
a warm or another client's requests make answers slow for reasons the models do not hold, and fitted in, they
would price every later plan wrong (once, after minutes of traffic behind warms, a cold prefill at a tenth of
its cost, so that every prompt went whole).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from common.selection import applied_keep_rate, extend_selection, fill_blocks, kept_importance, select_tokens
from common.tracing import span
from gateway.engines.replicas import Replica
from gateway.metrics import GatewayMetrics
from gateway.planning.costs import CostModel
from gateway.planning.draft import DraftClient
from gateway.planning.plan import Plan
from gateway.planning.policy import Reason, RequestOptions
from gateway.planning.prompt import Prompt
from gateway.planning.scores import ScoreProvider
from gateway.planning.selections import RecentPrompts, Selection
from gateway.settings import GatewaySettings

logger = logging.getLogger("specprefill.gateway")
TIERS = {"whole": 0, "fresh": 1, "extend": 2, "fresh_unprotected": 3}


class Context(NamedTuple):
    """What the planner knows of a prompt before the draft runs."""

    earlier: tuple[Selection, int] | None  # the earlier selection an extension would reuse, and the shared length
    held: int  # the system prompt's length where it stays whole (the engine holds it), else 0
    divergence: int | None  # where the next prompt is likely to part from this one
    recurring: bool  # a context likely to come back: worth warming


@dataclass(slots=True)
class Candidate:
    kind: str
    kept: Sequence[int] | None
    cached: int  # predicted engine cache hit
    seconds: float  # predicted target time
    protected: bool = False  # keeps the system prompt whole


class Planner:
    def __init__(
        self,
        settings: GatewaySettings,
        draft: DraftClient,
        scores: ScoreProvider,
        metrics: GatewayMetrics,
        special_ids: Collection[int],
        costs: tuple[CostModel, CostModel],
        *,
        replicas: list[Replica],
        positional: bool = True,
    ) -> None:
        self.settings = settings
        self.draft = draft
        self.scores = scores
        self.metrics = metrics
        self.special_ids = frozenset(special_ids)
        self.target_cost, self.draft_cost = costs
        self.positional = positional  # the backend reads positions (else kept tokens run contiguously)
        # each engine's cache (None: plan as if it kept nothing: text backends) and what it is doing now
        self.replicas = replicas
        self.selections: RecentPrompts[Selection] = RecentPrompts(capacity=64)

    async def plan(
        self,
        prompt: Prompt,
        options: RequestOptions,
        unsupported: list[str],
        *,
        dry_run: bool = False,
        scored: tuple[torch.Tensor, str] | None = None,
        replica: Replica | None = None,
        whole: Candidate | None = None,
    ) -> Plan:
        """The plan for ``prompt`` at ``replica`` (default: the first; ``routing`` chooses among several, and
        prices the whole prompt there on the way: ``whole``). ``prompt.keep`` marks tokens to keep whole if
        affordable (a system prompt); ``prompt.boundary``: where the last message begins (a chat's), the point
        another user's request would leave this one's; ``scored``: the prompt's scores and their cache status when
        already at hand (the inspector's keep rates)."""
        token_ids, keep, boundary = prompt.token_ids, prompt.keep, prompt.boundary
        if not dry_run:
            self.metrics.original_tokens.observe(len(token_ids))
        # once: every lookup below compares arrays (a 12,000-token list takes 0.4 ms)
        tokens = prompt.token_array()
        replica = replica or self.replicas[0]
        with span("specprefill.plan", **{"specprefill.replica": replica.index}):
            whole = whole or await self.candidate("whole", tokens, None, replica)
            plan = await self._plan(token_ids, tokens, options, unsupported, keep, boundary, scored, replica, whole)
        if not dry_run and plan.status == "compressed":
            self.metrics.keep_rate.observe(plan.keep_rate)  # the rate applied (auto: the one the scores chose)
        return plan.but(replica=replica, tokens=tokens)

    async def _plan(
        self,
        token_ids: list[int],
        tokens: np.ndarray,
        options: RequestOptions,
        unsupported: list[str],
        keep: torch.Tensor | None,
        boundary: int | None,
        scored: tuple[torch.Tensor, str] | None,
        replica: Replica,
        whole: Candidate,
    ) -> Plan:
        n = len(token_ids)
        wait = replica.load.wait_s()
        if (bypass := self._bypass(token_ids, options, unsupported)) is not None:
            return self._priced(bypass, whole)
        priced = self.settings.planner == "cost"
        if priced and self._whole_as_direct(whole, n, boundary):
            return self._as_plan(whole, token_ids, options, reason=Reason.CACHED)
        context = self._context(tokens, keep, boundary, whole, replica)
        draft_new = n - self.draft.reusable_prefix(tokens)
        draft_s = self.draft_cost.predict(draft_new, n - draft_new)
        # the draft runs while the requests ahead are at the engine: only what outlasts that wait costs more
        least_target = self.least_target(n, options, context.earlier, context.held, whole.cached)
        least = max(0.0, draft_s - wait) + least_target
        if priced and whole.seconds <= (1 + self.settings.plan_slack) * least:
            return self._as_plan(whole, token_ids, options, reason=Reason.CHEAPER_WHOLE)
        # a late draft is waited for while it can still save time: giving up sends the whole prompt, the dearest
        deadline = max(self.settings.draft_timeout, wait + whole.seconds - least_target if priced else 0.0)
        scores, cache, draft_ms = await self._drafted(token_ids, scored, replica, draft_new, deadline)
        if scores is None:  # any draft fault: the full prompt goes through instead
            return self._priced(Plan(token_ids, reason=Reason.DRAFT_ERROR, draft_ms=draft_ms), whole)
        start = time.perf_counter()
        if options.auto is not None:  # the scores choose this prompt's rate (common.selection.AutoKeepRate)
            config = self.draft.config
            options = options.applied(
                applied_keep_rate(options.auto, token_ids, scores, config, self.special_ids, keep)
            )
        compressed = await self._compressed(token_ids, tokens, scores, options.keep_rate, keep, context, replica)
        chosen = self._choose([whole, *compressed]) if priced else compressed[0]
        return self._as_plan(
            chosen,
            token_ids,
            options,
            reason=Reason.CHEAPER_WHOLE if chosen.kind == "whole" else None,
            cache=cache,
            draft_ms=draft_ms,
            protected=chosen.protected,
            recurring=context.recurring,
            select_ms=(time.perf_counter() - start) * 1e3,
        )

    def _whole_as_direct(self, whole: Candidate, n: int, boundary: int | None) -> bool:
        """The engine holds ``--whole-when-cached`` of the prompt and reading the rest costs about what going
        direct would: an engine that served every turn whole holds all before the last message (``boundary``).
        Where earlier turns went compressed, the engine holds less of their text than that, and the whole prompt
        is priced like any plan (a Claude Code turn with 93% held read 2,501 new tokens whole in 66 s, where
        direct read its last message in 6.5 s)."""
        share = self.settings.whole_when_cached
        if not share or whole.cached < share * n:
            return False
        held = max(whole.cached, boundary or 0)
        return whole.seconds <= (1 + self.settings.plan_slack) * self.target_cost.predict(n - held, held)

    def _context(
        self, tokens: np.ndarray, keep: torch.Tensor | None, boundary: int | None, whole: Candidate, replica: Replica
    ) -> Context:
        """What the planner knows of this prompt before the draft runs."""
        seen = self.selections.longest_shared(tokens)
        began_like = self.began_like(seen, len(tokens))
        earlier = seen if self.settings.planner == "cost" and replica.cache is not None else None
        held = self.held_system(keep, whole.cached, replica)
        if held and earlier is not None and not earlier[0].protected:
            earlier = None  # it compressed the system prompt, which is to stay whole now
        # likely to come back, so worth warming: a system prompt (shared by users), or a prompt that begins with
        # most of an earlier one (a chat's next turn, the same document again); a fresh document each time is not
        recurring = (keep is not None and bool(keep.any())) or began_like is not None
        return Context(earlier, held, self._divergence(keep, boundary, began_like), recurring)

    async def _drafted(
        self,
        token_ids: list[int],
        scored: tuple[torch.Tensor, str] | None,
        replica: Replica,
        draft_new: int,
        deadline_s: float,
    ) -> tuple[torch.Tensor | None, str, float]:
        """The prompt's scores (None: the draft failed, or took ``deadline_s``), their cache status and the draft's
        milliseconds; the draft's cost model learns the time where nothing else shared the hardware."""
        start = time.perf_counter()
        before = replica.load.snapshot()
        try:
            if scored is None:
                with span("specprefill.draft", **{"specprefill.prompt_tokens": len(token_ids)}):
                    scored = await asyncio.wait_for(self.scores.scores(token_ids), deadline_s)
                fresh = True
            else:
                fresh = False
            scores, cache = scored
        except Exception as exc:
            draft_ms = (time.perf_counter() - start) * 1e3
            self.metrics.draft_latency.labels("error").observe(draft_ms / 1e3)
            logger.warning(
                "draft failed, forwarding the full prompt: %s", type(exc).__name__ + (f": {exc}" if str(exc) else "")
            )
            return None, "off", draft_ms
        draft_ms = (time.perf_counter() - start) * 1e3
        if cache != "hit" and fresh:
            self.metrics.draft_latency.labels("ok").observe(draft_ms / 1e3)
            if replica.load.undisturbed(
                before
            ):  # a draft that shared the hardware with the engine's work: not its cost
                n = len(token_ids)
                self.draft_cost.observe(draft_new, n - draft_new, draft_ms / 1e3)
        return scores, cache, draft_ms

    def _bypass(self, token_ids: list[int], options: RequestOptions, unsupported: list[str]) -> Plan | None:
        """The reasons to send the prompt whole that need no pricing."""
        reason = self._bypass_reason(len(token_ids), options, unsupported)
        if reason is None:
            return None
        return Plan(token_ids, reason=reason, passthrough=reason == Reason.OFF or bool(unsupported))

    def _bypass_reason(self, n: int, options: RequestOptions, unsupported: list[str]) -> str | None:
        if not options.enabled:
            return Reason.OFF
        if unsupported:
            return Reason.unsupported(unsupported[0])
        if options.keep_rate >= 1.0 and options.auto is None:
            return Reason.KEEP_RATE_ONE
        if n < self.settings.min_prompt_tokens:
            return Reason.SHORT_PROMPT
        if n > self.draft.max_prompt_tokens:
            return Reason.PROMPT_TOO_LONG
        return None

    def whole_for_any(self, most: int, options: RequestOptions, unsupported: list[str]) -> bool:
        """Whether every prompt of at most ``most`` tokens with these options goes whole, for a reason that needs
        neither its tokens nor a price (``_bypass``): what lets the gateway send such a request before it has
        tokenized and planned it (``GatewayServing.serve``)."""
        reason = self._bypass_reason(most, options, unsupported)
        return reason is not None and reason != Reason.PROMPT_TOO_LONG

    async def candidate(
        self, kind: str, tokens: np.ndarray, kept: Sequence[int] | None, replica: Replica, protected: bool = False
    ) -> Candidate:
        cached = await self._cached(tokens, kept, replica)
        sent = len(tokens) if kept is None else len(kept)
        return Candidate(kind, kept, cached, self.target_cost.predict(sent - cached, cached), protected)

    async def _cached(self, tokens: np.ndarray, kept: Sequence[int] | None, replica: Replica) -> int:
        """The leading tokens of this prompt (of its ``kept`` tokens at their positions) ``replica`` holds."""
        if replica.cache is None:
            return 0
        return await replica.cache.cached_tokens(
            tokens if kept is None else tokens[np.asarray(kept, dtype=np.intp)], kept if self.positional else None
        )

    @staticmethod
    def began_like(seen: tuple[Selection, int] | None, n: int) -> tuple[Selection, int] | None:
        """The earlier selection this prompt of ``n`` tokens began like, where it shares most of it (a chat's
        next turn, the same document again); not one that shares only a chat template's first tokens."""
        return seen if seen is not None and 2 * seen[1] >= n else None

    @staticmethod
    def _divergence(keep: torch.Tensor | None, boundary: int | None, seen: tuple[Selection, int] | None) -> int | None:
        """Where the next request on this context most likely leaves this prompt, from how this one left the
        earlier prompt it began like: continued it (a chat's next turn, an agent's next step): the next one
        continues this one, past its end, so nowhere inside; replaced its end (the same document, another
        question): there again, or where the last message begins if that came first (the next user of a
        system prompt). Without an earlier prompt (``seen``: the one it began like), where the last message begins
        after a system prompt."""
        has_system = keep is not None and bool(keep.any()) and boundary is not None and boundary > 0
        if seen is not None and seen[1] > 0:
            selection, shared = seen
            if shared >= selection.length:
                return None
            return boundary if has_system and boundary is not None and shared >= boundary else shared
        return boundary if has_system else None

    @staticmethod
    def held_system(keep: torch.Tensor | None, cached: int, replica: Replica) -> int:
        """The system prompt's length if it must stay whole: the engine holds it (warming put it there), so
        keeping it costs nothing more, shared prefixes stay cacheable and instructions do not fade. Else 0."""
        flags = keep.numpy() if keep is not None else None
        if flags is None or not flags.any():
            return 0
        end = len(flags) - int(np.argmax(flags[::-1]))  # one past the last (torch's nonzero lists them all)
        block = replica.cache.block_size if replica.cache is not None else 1
        return end if cached + block > end else 0

    def least_target(
        self,
        n: int,
        options: RequestOptions,
        earlier: tuple[Selection, int] | None,
        held: int,
        cached: int,
        head_cached: int | None = None,
    ) -> float:
        """The least target time a compressed plan could take, before the draft says which tokens it keeps;
        ``held``: leading tokens kept whole (a system prompt); ``cached``: the prompt's leading tokens the
        engine holds. Held tokens past the cached ones are read anew, as the whole prompt reads them. An
        extension of ``earlier`` reads its kept tokens below where the prompts part from the engine's cache:
        ``head_cached`` of them (None: all)."""
        chunk = self.draft.config.chunk_for(n - held, options.keep_rate)
        kept = min(n, held + math.ceil(math.ceil((n - held) / chunk) * options.keep_rate) * chunk)
        served = min(held, cached)
        least = self.target_cost.predict(kept - served, served)
        if earlier is not None and earlier[0].keep_rate >= options.keep_rate:
            start = min(earlier[1], n - 1)
            head = sum(1 for i in earlier[0].kept if i < start)
            served = head if head_cached is None else min(head, head_cached)
            tail = math.ceil(math.ceil((n - start) / chunk) * options.keep_rate) * chunk
            least = min(least, self.target_cost.predict(tail + head - served, served))
        return least

    async def _compressed(
        self,
        token_ids: list[int],
        tokens: np.ndarray,
        scores: torch.Tensor,
        keep_rate: float,
        keep: torch.Tensor | None,
        context: Context,
        replica: Replica,
    ) -> list[Candidate]:
        """The compressed candidates, each filled to whole engine blocks below where the next prompt is likely to
        part from this one (``fill_blocks``)."""
        config, earlier, held, divergence = self.draft.config, context.earlier, context.held > 0, context.divergence
        block = replica.cache.block_size if replica.cache is not None and divergence else 1

        async def filled(kept: list[int]) -> list[int]:
            if block == 1 or divergence is None:
                return kept
            # what the engine holds of this selection stays where it is: filling goes after it
            cached = await self._cached(tokens, kept, replica)
            return fill_blocks(kept, divergence, block, floor=kept[cached - 1] + 1 if cached else 0)

        has_system = keep is not None and bool(keep.any())
        fresh = select_tokens(token_ids, scores, keep_rate, config, self.special_ids, keep)
        candidates = [await self.candidate("fresh", tokens, await filled(fresh), replica, protected=has_system)]
        plain = fresh
        if has_system:
            plain = select_tokens(token_ids, scores, keep_rate, config, self.special_ids)
            if self.settings.planner == "cost" and not held:
                candidates.append(await self.candidate("fresh_unprotected", tokens, await filled(plain), replica))
        if earlier is not None:
            selection, shared = earlier
            start = min(shared, len(token_ids) - 1)
            # an earlier selection is held against a fresh one of its own kind: one that compressed the system
            # prompt against one that does too (no compressed selection covers a system prompt kept whole)
            reference = fresh if selection.protected else plain
            if (
                start > 0
                and selection.keep_rate >= keep_rate
                and self._covers(scores, selection.kept, reference, start, keep_rate)
            ):
                extended = extend_selection(
                    token_ids,
                    scores,
                    keep_rate,
                    config,
                    selection.kept,
                    start,
                    self.special_ids,
                    keep if selection.protected else None,
                )
                candidates.append(
                    await self.candidate(
                        "extend", tokens, await filled(extended), replica, protected=has_system and selection.protected
                    )
                )
        return candidates

    def _covers(
        self, scores: torch.Tensor, reused: tuple[int, ...], fresh: list[int], end: int, keep_rate: float
    ) -> bool:
        """Whether the earlier selection keeps, below ``end``, enough of what a fresh one would keep there (in the
        fresh selection's chunks)."""
        chunk = self.draft.config.chunk_for(scores.numel(), keep_rate)
        wanted = kept_importance(scores, fresh, end, chunk)
        return wanted == 0 or kept_importance(scores, reused, end, chunk) >= self.settings.reuse_threshold * wanted

    async def priced(self, plan: Plan) -> Plan:
        """``plan`` with its predictions at its replica, for a plan that goes elsewhere than it was priced for: to
        another replica (its own is down), or whole (its swap was refused)."""
        there = await self.candidate(plan.kind, plan.token_array(), plan.position_ids, plan.placed)
        return plan.but(engine_cached=there.cached, target_s=there.seconds)

    def _choose(self, candidates: list[Candidate]) -> Candidate:
        """The cheapest, unless one that keeps more of the prompt costs at most ``plan_slack`` more."""
        cheapest = min(c.seconds for c in candidates)
        affordable = [c for c in candidates if c.seconds <= (1 + self.settings.plan_slack) * cheapest]
        return min(affordable, key=lambda c: (TIERS[c.kind], c.seconds))

    def _as_plan(
        self,
        chosen: Candidate,
        token_ids: list[int],
        options: RequestOptions,
        *,
        reason: str | None,
        cache: str = "off",
        draft_ms: float = 0.0,
        protected: bool = False,
        recurring: bool = False,
        select_ms: float = 0.0,
    ) -> Plan:
        kind = "fresh" if chosen.kind == "fresh_unprotected" else chosen.kind
        compressed = chosen.kept is not None
        plan = Plan(
            token_ids,
            status="compressed" if compressed else "bypassed",
            reason=reason,
            position_ids=chosen.kept,
            keep_rate=options.keep_rate if compressed else 1.0,
            cache=cache,
            draft_ms=draft_ms,
            kind=kind,
            protected=protected and compressed,
            recurring=recurring,
            select_ms=select_ms,
        )
        return self._priced(plan, chosen)

    @staticmethod
    def _priced(plan: Plan, chosen: Candidate) -> Plan:
        """The plan with its predictions: the engine's cache hit and its own time (the wait ahead of it is the
        trace's, estimated when it is sent)."""
        return plan.but(engine_cached=chosen.cached, target_s=chosen.seconds)

    async def close(self) -> None:
        await self.scores.close()

    # --- what happened: the engine's cache, the cost models, the selections later prompts may reuse ---

    async def completed(
        self, plan: Plan, usage: dict[str, Any] | None, backend_s: float, *, contended: bool = False
    ) -> None:
        """A backend answered ``plan`` (its first event after ``backend_s``); ``usage`` as the backend reported it;
        ``contended``: something else ran at the engine meanwhile, so the timing is not the plan's own cost.
        A request whose prompt the gateway did not read (images, an unrenderable Responses input) teaches nothing."""
        sent = plan.kept_array()
        if not len(sent):
            return
        engine_cache = (plan.replica or self.replicas[0]).cache
        cached = cached_tokens(usage)
        positions = plan.position_ids if self.positional else None
        if cached is not None:
            self.metrics.engine_cache_error.observe(cached - plan.engine_cached)
            if cached < plan.engine_cached and engine_cache is not None:
                await engine_cache.corrected(sent, positions, cached)
        else:
            cached = plan.engine_cached
        if not contended:
            self.target_cost.observe(len(sent) - cached, cached, backend_s)
        if engine_cache is not None:
            await engine_cache.record(sent, positions)
        if plan.status == "compressed" and plan.position_ids is not None:
            self.selections.add(
                plan.token_array(),
                Selection(tuple(plan.position_ids), plan.keep_rate, plan.protected, len(plan.token_ids)),
            )
        self.metrics.plans.labels(plan.kind).inc()


def cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """Prompt tokens the engine served from its cache, from a chat/completion usage, a Responses usage or an
    Anthropic usage."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
    return cached if isinstance(cached, int) else None

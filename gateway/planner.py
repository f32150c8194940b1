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

With several replicas (``route``), each request goes to the one where its best plan costs least before the
draft runs: the whole prompt against what that replica's cache holds of it, the earlier selection it would
extend against what that replica holds of that, and the wait there. As between plans, a replica that holds the
prompt's context (``AFFINITY``: half the prompt, or half the earlier selection it extends, as SGLang's router
counts a prefix match) wins while it costs at most ``plan_slack`` more than the cheapest (cost models fitted on
live timings do not always tell a few hundred cached tokens apart); then the cheaper, then the one with the
fewest requests at it, then the one chosen longest ago. A conversation so stays where its context is, and cold
prompts spread over idle replicas.

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
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from common.selection import extend_selection, fill_blocks, kept_importance, select_tokens
from gateway.costs import CostModel
from gateway.draft import DraftClient
from gateway.engine_load import EngineLoad
from gateway.metrics import GatewayMetrics
from gateway.plan import Plan
from gateway.policy import Reason, RequestOptions
from gateway.replicas import Replica
from gateway.scores import ScoreProvider
from gateway.selections import RecentPrompts, Selection
from gateway.settings import GatewaySettings

logger = logging.getLogger("specprefill.gateway")
TIERS = {"whole": 0, "fresh": 1, "extend": 2, "fresh_unprotected": 3}
AFFINITY = 0.5  # a replica holds a prompt's context when it holds this share of it (SGLang's cache_threshold)


@dataclass(slots=True)
class Candidate:
    kind: str
    kept: list[int] | None
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
        positional: bool = True,
        replicas: list[Replica] | None = None,
    ) -> None:
        self.settings = settings
        self.draft = draft
        self.scores = scores
        self.metrics = metrics
        self.special_ids = frozenset(special_ids)
        self.target_cost, self.draft_cost = costs
        self.positional = positional  # the backend reads positions (else kept tokens run contiguously)
        # each engine's cache (None: plan as if it kept nothing: text backends) and what it is doing now
        self.replicas = replicas or [Replica(0, "in-process", None, EngineLoad(), None)]
        self.selections: RecentPrompts[Selection] = RecentPrompts(capacity=64)
        self._routed = 0

    async def plan(
        self,
        token_ids: list[int],
        options: RequestOptions,
        unsupported: list[str],
        keep: torch.Tensor | None = None,
        *,
        boundary: int | None = None,
        dry_run: bool = False,
        scored: tuple[torch.Tensor, str] | None = None,
        replica: Replica | None = None,
    ) -> Plan:
        """The plan for this prompt, at ``replica`` (default: where ``route`` sends it). ``keep`` marks tokens to
        keep whole if affordable (a system prompt); ``boundary``: where the last message begins (a chat's), the
        point another user's request would leave this one's; ``scored``: the prompt's scores and their cache
        status when already at hand (the inspector's keep rates)."""
        n = len(token_ids)
        if not dry_run:
            self.metrics.original_tokens.observe(n)
        tokens = np.asarray(token_ids, dtype=np.int64)  # once: every lookup below compares arrays
        whole = None
        if replica is None:
            replica, whole = await self.route(tokens, options, keep, dry_run=dry_run)
        plan = await self._plan(
            token_ids, tokens, options, unsupported, keep, boundary, dry_run, scored, replica, whole
        )
        plan.replica = replica
        return plan

    async def _plan(
        self,
        token_ids: list[int],
        tokens: np.ndarray,
        options: RequestOptions,
        unsupported: list[str],
        keep: torch.Tensor | None,
        boundary: int | None,
        dry_run: bool,
        scored: tuple[torch.Tensor, str] | None,
        replica: Replica,
        whole: Candidate | None,
    ) -> Plan:
        """``whole``: the whole prompt's candidate at ``replica`` where routing priced it already."""
        n = len(token_ids)
        wait = replica.load.wait_s()
        whole = whole or await self._candidate("whole", tokens, None, replica)
        if (bypass := self._bypass(token_ids, options, unsupported)) is not None:
            return self._priced(bypass, whole, wait)
        priced = self.settings.planner == "cost"
        if priced and self.settings.whole_when_cached and whole.cached >= self.settings.whole_when_cached * n:
            return self._as_plan(whole, token_ids, options, reason=Reason.CACHED, wait=wait)
        seen = self.selections.longest_shared(tokens)
        began_like = self._began_like(seen, n)
        # likely to come back, so worth warming: a system prompt (shared by users), or a prompt that begins with
        # most of an earlier one (a chat's next turn, the same document again); a fresh document each time is not
        recurring = (keep is not None and bool(keep.any())) or began_like is not None
        earlier = seen if priced and replica.cache is not None else None
        held = self._held_system(keep, whole.cached, replica)
        if held and earlier is not None and not earlier[0].protected:
            earlier = None  # it compressed the system prompt, which is to stay whole now
        divergence = self._divergence(keep, boundary, began_like)
        draft_new = n - self.draft.reusable_prefix(tokens)
        draft_s = self.draft_cost.predict(draft_new, n - draft_new)
        # the draft runs while the requests ahead are at the engine: only what outlasts that wait costs more
        least = max(0.0, draft_s - wait) + self._least_target(n, options, earlier, held, whole.cached, None)
        if priced and whole.seconds <= (1 + self.settings.plan_slack) * least:
            return self._as_plan(whole, token_ids, options, reason=Reason.CHEAPER_WHOLE, wait=wait)
        start = time.perf_counter()
        before = replica.load.snapshot()
        try:
            scores, cache = scored or await asyncio.wait_for(self.scores.scores(token_ids), self.settings.draft_timeout)
        except Exception as exc:  # any draft fault: the full prompt goes through instead
            draft_ms = (time.perf_counter() - start) * 1e3
            self.metrics.draft_latency.labels("error").observe(draft_ms / 1e3)
            logger.warning(
                "draft failed, forwarding the full prompt: %s", type(exc).__name__ + (f": {exc}" if str(exc) else "")
            )
            return self._priced(
                Plan(token_ids, reason=Reason.DRAFT_ERROR, draft_ms=draft_ms), whole, max(0.0, wait - draft_ms / 1e3)
            )
        draft_ms = (time.perf_counter() - start) * 1e3
        if cache != "hit" and scored is None:
            self.metrics.draft_latency.labels("ok").observe(draft_ms / 1e3)
            if replica.load.undisturbed(
                before
            ):  # a draft that shared the hardware with the engine's work: not its cost
                self.draft_cost.observe(draft_new, n - draft_new, draft_ms / 1e3)
        start = time.perf_counter()
        compressed = await self._compressed(
            token_ids, tokens, scores, options.keep_rate, keep, earlier, held > 0, divergence, replica
        )
        chosen = self._choose([whole, *compressed]) if priced else compressed[0]
        reason = Reason.CHEAPER_WHOLE if chosen.kind == "whole" else None
        plan = self._as_plan(
            chosen,
            token_ids,
            options,
            reason=reason,
            cache=cache,
            draft_ms=draft_ms,
            protected=chosen.protected,
            wait=max(0.0, wait - draft_ms / 1e3),
        )
        plan.select_ms = (time.perf_counter() - start) * 1e3
        plan.recurring = recurring
        if not dry_run and plan.status == "compressed":
            self.metrics.keep_rate.observe(options.keep_rate)
        return plan

    def _bypass(self, token_ids: list[int], options: RequestOptions, unsupported: list[str]) -> Plan | None:
        """The reasons to send the prompt whole that need no pricing."""
        n = len(token_ids)
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
        return None

    async def _candidate(
        self, kind: str, tokens: np.ndarray, kept: list[int] | None, replica: Replica, protected: bool = False
    ) -> Candidate:
        cached = await self._cached(tokens, kept, replica)
        sent = len(tokens) if kept is None else len(kept)
        return Candidate(kind, kept, cached, self.target_cost.predict(sent - cached, cached), protected)

    async def _cached(self, tokens: np.ndarray, kept: list[int] | None, replica: Replica) -> int:
        """The leading tokens of this prompt (of its ``kept`` tokens at their positions) ``replica`` holds."""
        if replica.cache is None:
            return 0
        return await replica.cache.cached_tokens(
            tokens if kept is None else tokens[kept], kept if self.positional else None
        )

    async def route(
        self, tokens: np.ndarray, options: RequestOptions, keep: torch.Tensor | None, *, dry_run: bool = False
    ) -> tuple[Replica, Candidate | None]:
        """The replica where this prompt costs least now (see the module's docstring), among the replicas that are
        up (all of them when none is), and the whole prompt's candidate there (None: one replica, not priced)."""
        live = [r for r in self.replicas if r.up] or self.replicas
        chosen, whole = live[0], None
        if len(live) > 1:
            n = len(tokens)
            seen = self.selections.longest_shared(tokens)
            began_like = self._began_like(seen, n) is not None  # its context: more than a template's first tokens
            compressible = options.enabled and options.keep_rate < 1 and n >= self.settings.min_prompt_tokens
            priced = {}
            for replica in live:
                candidate = await self._candidate("whole", tokens, None, replica)
                least, earlier, head_cached = candidate.seconds, None, None
                share = candidate.cached / max(1, n)
                if compressible:
                    if seen is not None and replica.cache is not None:
                        earlier = seen
                        head = [i for i in seen[0].kept if i < min(seen[1], n - 1)]
                        head_cached = (await self._candidate("extend", tokens, head, replica)).cached
                        if began_like:
                            share = max(share, head_cached / max(1, len(head)))
                    held = self._held_system(keep, candidate.cached, replica)
                    least = min(least, self._least_target(n, options, earlier, held, candidate.cached, head_cached))
                holds = share >= AFFINITY  # the prompt's context (the whole prompt, or the selection it extends)
                priced[replica] = (replica.load.wait_s() + least, not holds, candidate)
            # as between plans: the one that keeps more (here, of the context) wins within plan_slack of the cheapest
            cheapest = min(cost for cost, _, _ in priced.values())
            affordable = [r for r in live if priced[r][0] <= (1 + self.settings.plan_slack) * cheapest]
            chosen = min(affordable, key=lambda r: (priced[r][1], priced[r][0], r.load.outstanding, r.routed))
            whole = priced[chosen][2]
        if not dry_run:
            self._routed += 1
            chosen.routed = self._routed
        return chosen, whole

    @staticmethod
    def _began_like(seen: tuple[Selection, int] | None, n: int) -> tuple[Selection, int] | None:
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
        has_system = keep is not None and bool(keep.any()) and bool(boundary)
        if seen is not None and seen[1] > 0:
            selection, shared = seen
            if shared >= selection.length:
                return None
            return boundary if has_system and shared >= boundary else shared
        return boundary if has_system else None

    @staticmethod
    def _held_system(keep: torch.Tensor | None, cached: int, replica: Replica) -> int:
        """The system prompt's length if it must stay whole: the engine holds it (warming put it there), so
        keeping it costs nothing more, shared prefixes stay cacheable and instructions do not fade. Else 0."""
        if keep is None or not bool(keep.any()):
            return 0
        end = int(keep.nonzero().max()) + 1
        block = replica.cache.block_size if replica.cache is not None else 1
        return end if cached + block > end else 0

    def _least_target(
        self,
        n: int,
        options: RequestOptions,
        earlier: tuple[Selection, int] | None,
        held: int,
        cached: int,
        head_cached: int | None,
    ) -> float:
        """The least target time a compressed plan could take, before the draft says which tokens it keeps;
        ``held``: leading tokens kept whole (a system prompt); ``cached``: the prompt's leading tokens the
        engine holds. Held tokens past the cached ones are read anew, as the whole prompt reads them. An
        extension of ``earlier`` reads its kept tokens below where the prompts part from the engine's cache:
        ``head_cached`` of them (None: all)."""
        chunk = self.draft.config.chunk_size
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
        earlier: tuple[Selection, int] | None,
        held: bool,
        divergence: int | None,
        replica: Replica,
    ) -> list[Candidate]:
        """The compressed candidates, each filled to whole engine blocks below ``divergence`` (``fill_blocks``)."""
        config = self.draft.config
        block = replica.cache.block_size if replica.cache is not None and divergence else 1

        async def filled(kept: list[int]) -> list[int]:
            if block == 1:
                return kept
            # what the engine holds of this selection stays where it is: filling goes after it
            cached = await self._cached(tokens, kept, replica)
            return fill_blocks(kept, divergence, block, floor=kept[cached - 1] + 1 if cached else 0)

        has_system = keep is not None and bool(keep.any())
        fresh = select_tokens(token_ids, scores, keep_rate, config, self.special_ids, keep)
        candidates = [await self._candidate("fresh", tokens, await filled(fresh), replica, protected=has_system)]
        plain = fresh
        if has_system:
            plain = select_tokens(token_ids, scores, keep_rate, config, self.special_ids)
            if self.settings.planner == "cost" and not held:
                candidates.append(await self._candidate("fresh_unprotected", tokens, await filled(plain), replica))
        if earlier is not None:
            selection, shared = earlier
            start = min(shared, len(token_ids) - 1)
            # an earlier selection is held against a fresh one of its own kind: one that compressed the system
            # prompt against one that does too (no compressed selection covers a system prompt kept whole)
            reference = fresh if selection.protected else plain
            if (
                start > 0
                and selection.keep_rate >= keep_rate
                and self._covers(scores, selection.kept, reference, start)
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
                    await self._candidate(
                        "extend", tokens, await filled(extended), replica, protected=has_system and selection.protected
                    )
                )
        return candidates

    def _covers(self, scores: torch.Tensor, reused: tuple[int, ...], fresh: list[int], end: int) -> bool:
        """Whether the earlier selection keeps, below ``end``, enough of what a fresh one would keep there."""
        chunk = self.draft.config.chunk_size
        wanted = kept_importance(scores, fresh, end, chunk)
        return wanted == 0 or kept_importance(scores, reused, end, chunk) >= self.settings.reuse_threshold * wanted

    async def priced(self, plan: Plan) -> None:
        """``plan``'s predictions at its replica, for a plan that goes elsewhere than it was priced for: to
        another replica (its own is down), or whole (its swap was refused)."""
        there = await self._candidate(
            plan.kind, np.asarray(plan.token_ids, dtype=np.int64), plan.kept_indices, plan.replica
        )
        plan.engine_cached, plan.target_s = there.cached, there.seconds

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
        wait: float = 0.0,
    ) -> Plan:
        kind = "fresh" if chosen.kind == "fresh_unprotected" else chosen.kind
        compressed = chosen.kept is not None
        plan = Plan(
            token_ids,
            status="compressed" if compressed else "bypassed",
            reason=reason,
            kept_indices=chosen.kept,
            keep_rate=options.keep_rate if compressed else 1.0,
            cache=cache,
            draft_ms=draft_ms,
            kind=kind,
            protected=protected and compressed,
        )
        return self._priced(plan, chosen, wait)

    @staticmethod
    def _priced(plan: Plan, chosen: Candidate, wait: float) -> Plan:
        """The plan with its predictions: the engine's cache hit, its own time, and the wait ahead of it."""
        plan.engine_cached, plan.target_s, plan.wait_ms = chosen.cached, chosen.seconds, wait * 1e3
        plan.predicted_ms = (wait + chosen.seconds) * 1e3
        return plan

    async def close(self) -> None:
        await self.scores.close()

    # --- what happened: the engine's cache, the cost models, the selections later prompts may reuse ---

    async def completed(self, plan: Plan, usage: dict | None, backend_s: float, *, contended: bool = False) -> None:
        """A backend answered ``plan`` (its first event after ``backend_s``); ``usage`` as the backend reported it;
        ``contended``: something else ran at the engine meanwhile, so the timing is not the plan's own cost.
        A request whose prompt the gateway did not read (images, an unrenderable Responses input) teaches nothing."""
        sent = plan.kept_token_ids()
        if not sent:
            return
        engine_cache = (plan.replica or self.replicas[0]).cache
        cached = _cached_tokens(usage)
        positions = plan.kept_indices if self.positional else None
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
        if plan.status == "compressed":
            self.selections.add(
                plan.token_ids, Selection(tuple(plan.kept_indices), plan.keep_rate, plan.protected, len(plan.token_ids))
            )
        self.metrics.plans.labels(plan.kind).inc()

    async def calibrate(
        self,
        complete,
        vocab: list[int],
        sizes: tuple[int, ...] = (256, 1024, 4096),
        extensions: tuple[int, ...] = (32, 512),
        reads: int = 2,
        limit: int | None = None,
        grow_below_s: float = 0.5,
    ) -> None:
        """The start-up probe through ``complete(token_ids)`` (the target, one token: its completion answer) and
        the draft. First an unmeasured warm-up (a GPU's first forwards load kernels and libraries: timed, they
        made the draft look seconds slow and the gateway forward every prompt whole). Then random prompts of
        ``sizes`` tokens, doubling on while the target answers the largest within ``grow_below_s`` (a GPU reads
        4,096 tokens in a fraction of that, and prices met in traffic should be interpolated, not extrapolated
        eightfold); then the largest extended by each of ``extensions`` in turn (few new tokens after many cached
        ones, as a chat's next turn); both models fitted on the timings. Then ``reads`` short reads (16 new
        tokens) after each prompt but the smallest: the same few new tokens after 1,024 and after 4,096 cached
        ones are what tells the cost of reading cached tokens apart from a request's fixed part. (Without them,
        and with 2,048 tokens at most, the fit priced reading 12,000 cached tokens at nothing.) Sizes are cut to
        fit ``limit``. A probe the backend refuses ends the probe; the models keep what they learnt so far and
        learn from traffic."""
        generator = torch.Generator().manual_seed(0)
        pool = torch.as_tensor(vocab)

        def tokens(n: int) -> list[int]:
            return pool[torch.randint(len(vocab), (n,), generator=generator)].tolist()

        async def probe(prompt: list[int], cached: int, measured: bool = True) -> float:
            reused = self.draft.reusable_prefix(prompt)
            start = time.perf_counter()
            await self.draft.score(prompt)
            if measured:
                self.draft_cost.observe(len(prompt) - reused, reused, time.perf_counter() - start, probe=True)
            start = time.perf_counter()
            answer = await complete(prompt)
            seconds = time.perf_counter() - start
            served = _cached_tokens(answer.get("usage"))
            reports.append(served is not None)
            served = cached if served is None else served  # an engine that does not say: as sent
            if measured:
                self.target_cost.observe(len(prompt) - served, served, seconds, probe=True)
            if (cache := self.replicas[0].cache) is not None:
                await cache.record(prompt, None)
            return seconds

        room = max(1, min(self.draft.max_prompt_tokens, limit or 1 << 31) - sum(extensions))
        sizes = sorted({min(n, room) for n in sizes})
        bases: list[list[int]] = []  # the probed prompts but the smallest
        reports: list[bool] = []  # whether each answer said how many tokens the engine's cache served
        largest: list[int] = []
        try:
            await probe(tokens(min(64, room)), 0, measured=False)
            index = 0
            while index < len(sizes):
                prompt = tokens(sizes[index])
                seconds = await probe(prompt, 0)
                largest = prompt
                if index:
                    bases.append(prompt)
                if index == len(sizes) - 1 and seconds < grow_below_s and sizes[-1] < room:
                    sizes.append(min(2 * sizes[-1], room))
                index += 1
            previous = largest
            for n in extensions:
                prompt = previous + tokens(n)
                await probe(prompt, len(previous))
                previous = prompt
            for base in bases:
                for _ in range(reads):
                    await probe(base + tokens(16), len(base))
        except Exception as exc:  # a refused probe never stops the gateway from starting
            logger.warning("cost-model probe stopped: %s", type(exc).__name__ + (f": {exc}" if str(exc) else ""))
        logger.info(
            "cost models calibrated on prompts up to %d tokens: target %s, draft %s",
            sizes[-1],
            self.target_cost.describe(),
            self.draft_cost.describe(),
        )
        if reports and not any(reports):
            logger.warning(
                "the backend's answers do not say how many prompt tokens its prefix cache served "
                "(usage.prompt_tokens_details.cached_tokens; vLLM: --enable-prompt-tokens-details): the "
                "gateway then learns the engine's costs from its own guesses of what the cache held, "
                "and cannot tell how good they are"
            )


def _cached_tokens(usage: dict | None) -> int | None:
    """Prompt tokens the engine served from its cache, from a chat/completion usage, a Responses usage or an
    Anthropic usage."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
    return cached if isinstance(cached, int) else None

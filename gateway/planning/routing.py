"""Routing: which replica a request goes to. One rule for every request: where what it sends costs least now
(the engine's wait, then its time on what that replica's cache does not hold). A replica that holds the
request's context (``AFFINITY``: half its prompt, or half the earlier selection it would extend, as SGLang's
router counts a prefix match) wins while it costs at most ``plan_slack`` more than the cheapest (cost models
fitted on live timings do not always tell a few hundred cached tokens apart); then the cheaper, then the one
with the fewest requests at it, then the one chosen longest ago. A conversation so stays where its context is,
and cold prompts spread over idle replicas.

Before the draft runs (``route``), a prompt is priced by the least any of its plans could cost at each replica:
the whole prompt against what that replica's cache holds of it, the earlier selection it would extend against
what that replica holds of that. A decided plan (``place``: one that did not come from the planner, or whose
replica dropped it) is priced as it is."""

from __future__ import annotations

import math

import numpy as np
import torch

from gateway.engines.replicas import Replica
from gateway.planning.plan import Plan
from gateway.planning.planner import Candidate, Planner
from gateway.planning.policy import RequestOptions

AFFINITY = 0.5  # a replica holds a prompt's context when it holds this share of it (SGLang's cache_threshold)


class Router:
    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.replicas = planner.replicas
        self.plan_slack = planner.settings.plan_slack
        self._routed = 0

    def live(self) -> list[Replica]:
        """The replicas that are up (all of them when none is)."""
        return [r for r in self.replicas if r.up] or self.replicas

    async def route(
        self, tokens: np.ndarray, options: RequestOptions, keep: torch.Tensor | None, *, dry_run: bool = False
    ) -> tuple[Replica, Candidate | None]:
        """The replica for this prompt, and the whole prompt's candidate there (None: one replica, not priced)."""
        live = self.live()
        if len(live) == 1:
            return self._chosen(live[0], dry_run), None
        planner, n = self.planner, len(tokens)
        seen = planner.selections.longest_shared(tokens)
        began_like = planner.began_like(seen, n) is not None  # its context: more than a template's first tokens
        compressible = (
            options.enabled
            and (options.keep_rate < 1 or options.auto is not None)
            and n >= planner.settings.min_prompt_tokens
        )
        priced = {}
        for replica in live:
            whole = await planner.candidate("whole", tokens, None, replica)
            least, share = whole.seconds, whole.cached / max(1, n)
            if compressible:
                earlier, head_cached = None, None
                if seen is not None and replica.cache is not None:
                    earlier = seen
                    head = [i for i in seen[0].kept if i < min(seen[1], n - 1)]
                    head_cached = (await planner.candidate("extend", tokens, head, replica)).cached
                    if began_like:
                        share = max(share, head_cached / max(1, len(head)))
                held = planner.held_system(keep, whole.cached, replica)
                least = min(least, planner.least_target(n, options, earlier, held, whole.cached, head_cached))
            priced[replica] = (replica.load.wait_s() + least, share >= AFFINITY, whole)
        chosen = self._cheapest({r: cost[:2] for r, cost in priced.items()})
        return self._chosen(chosen, dry_run), priced[chosen][2]

    async def place(self, plan: Plan, among: list[Replica] | None = None) -> Plan:
        """``plan`` at the replica among ``among`` (default: those up) where it costs least, priced there."""
        live = among or self.live()
        tokens = plan.token_array()
        priced = {}
        for replica in live:
            there = await self.planner.candidate(plan.kind, tokens, plan.position_ids, replica)
            priced[replica] = (
                replica.load.wait_s() + there.seconds,
                there.cached >= AFFINITY * max(1, plan.kept_tokens),
            )
        chosen = self._chosen(self._cheapest(priced), dry_run=False)
        return await self.planner.priced(plan.but(replica=chosen))

    def _cheapest(self, priced: dict[Replica, tuple[float, bool]]) -> Replica:
        """The rule (the module's docstring) over each replica's (cost, whether it holds the context)."""
        cheapest = min((cost for cost, _ in priced.values() if math.isfinite(cost)), default=0.0)
        limit = cheapest + self.plan_slack * abs(cheapest)
        # every replica where no price is finite (a cost model gone wrong must not stop a request)
        affordable = [r for r, (cost, _) in priced.items() if cost <= limit] or list(priced)
        return min(affordable, key=lambda r: (not priced[r][1], priced[r][0], r.load.outstanding, r.routed))

    def _chosen(self, replica: Replica, dry_run: bool) -> Replica:
        if not dry_run:
            self._routed += 1
            replica.routed = self._routed
        return replica

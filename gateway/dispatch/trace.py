"""A request's trace: what happened to its plan at the backend, owned by the dispatcher. The plan it holds is
the one sent (another replica's, or the whole prompt's, where the first could not be); the timings are measured
when it was sent; the response headers say both."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.planning.plan import Plan


@dataclass(slots=True)
class Trace:
    plan: Plan
    wait_ms: float = 0.0  # the predicted wait for the requests ahead of it at the engine, when it was sent
    predicted_ms: float = 0.0  # the predicted backend time, when it was sent: the wait, then the target's time
    background_ms: float = 0.0  # time at the backend alongside this gateway's own background work
    backend_ms: float = 0.0  # request sent to first answer event received
    expected_s: float = 0.0  # the predicted backend time at the engine's idle speed (what its slowdown learns from)
    notes: dict[str, str] = field(default_factory=dict)  # headers the API surface adds (tools it left out)

    def headers(self) -> dict[str, str]:
        plan = self.plan
        headers = {
            "x-specprefill-status": plan.status,
            "x-specprefill-original-tokens": str(plan.original_tokens),
            "x-specprefill-kept-tokens": str(plan.kept_tokens),
            "x-specprefill-keep-rate": f"{plan.keep_rate:g}",
            "x-specprefill-cache": plan.cache,
            "x-specprefill-draft-ms": f"{plan.draft_ms:.1f}",
            "x-specprefill-plan": plan.kind,
        }
        if plan.reason:
            headers["x-specprefill-reason"] = plan.reason
        timings = (
            ("tokenize", plan.tokenize_ms),
            ("draft", plan.draft_ms),
            ("select", plan.select_ms),
            ("backend", self.backend_ms),
            ("predicted", self.predicted_ms),
            ("wait", self.wait_ms),
            ("background", self.background_ms),
        )
        headers["server-timing"] = ", ".join(f"{name};dur={value:.1f}" for name, value in timings) + (
            f', plan;desc="{plan.kind}", cached;desc="{plan.engine_cached}"'
        )
        if plan.replica is not None:
            headers["server-timing"] += f', replica;desc="{plan.replica.index}"'
        return headers | self.notes

"""Mixed sessions arriving as a Poisson process: the workload bench's ``poisson`` arrival mode.

Sessions start at Poisson times at a given rate (sessions per second) and run side by side; each is a short
sequence of requests of one kind, a think time apart:
  fresh      one question about a new document
  document   two questions about one of two shared documents (the documents other sessions ask about too)
  chat       three turns over a new document
  agent      three steps of an agent loop over a new task, each adding a tool output
  system     two questions from a user of the one shared system prompt
  short      three turns of a short chat (below the gateway's compression floor: it goes through whole)
Both paths get the same seeded schedule (start times, kinds, texts, think times), each on its own engine, one
path after the other. Per rate and path: TTFT p50 and p90 and each kind's median; across rates, the highest
rate at which each path's p90 TTFT stays under one objective (twice the direct path's p90 at the lowest rate):
the paper's max-QPS figure, measured on mixed traffic.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

from specprefill_lab.bench import PromptMaker, stream_ttft
from specprefill_lab.workloads import PathTarget, _agent, _chat, percentile, within_2x

KINDS = ("fresh", "document", "chat", "agent", "system", "short")
QUESTIONS = [f"\n\nQuestion {i + 1}: which number appears in sentence {3 * i + 2} of the text above?" for i in range(8)]


@dataclass
class Session:
    number: int
    kind: str
    start_s: float
    requests: list[list[dict]]  # each request's messages
    think_s: list[float]  # the pause before each request after the first


def session_schedule(
    prompts: PromptMaker,
    rate: float,
    count: int,
    tokens: int,
    step_tokens: int,
    seed: int,
    think: tuple[float, float] = (0.5, 2.0),
) -> list[Session]:
    """``count`` sessions at Poisson times of ``rate`` per second, kinds in a shuffled cycle (each equally often),
    contexts of ``tokens`` tokens (new ones for every schedule: the engines have seen none of them)."""
    rng = random.Random(seed)
    shared = [prompts.text(tokens) for _ in range(2)]
    system = prompts.text(tokens)
    kinds: list[str] = []
    while len(kinds) < count:
        cycle = list(KINDS)
        rng.shuffle(cycle)
        kinds += cycle
    sessions, start = [], 0.0
    for number, kind in enumerate(kinds[:count]):
        start += rng.expovariate(rate)
        questions = rng.sample(QUESTIONS, 3)
        if kind == "fresh":
            requests = [[{"role": "user", "content": prompts.text(tokens) + questions[0]}]]
        elif kind == "document":
            document = rng.choice(shared)
            requests = [[{"role": "user", "content": document + q}] for q in questions[:2]]
        elif kind == "chat":
            requests = _chat(prompts.text(tokens), questions)
        elif kind == "agent":
            requests = _agent(prompts, tokens, step_tokens, 3)
        elif kind == "system":
            requests = [
                [{"role": "system", "content": system}, {"role": "user", "content": q.strip()}] for q in questions[:2]
            ]
        else:
            requests = _chat(prompts.text(300), questions)
        think_s = [rng.uniform(*think) for _ in requests[1:]]
        sessions.append(Session(number, kind, start, requests, think_s))
    return sessions


@dataclass
class SessionSample:
    rate: float
    path: str
    session: int
    kind: str
    index: int  # the request's place in its session
    ttft_s: float | None  # None: the request failed
    plan: str | None = None
    timing_ms: dict[str, float] = field(default_factory=dict)


async def run_sessions(
    path: PathTarget, sessions: list[Session], rate: float, max_tokens: int = 1
) -> list[SessionSample]:
    """Every session through ``path``, each starting at its time and sending its next request when the previous
    answer has ended and its think time passed."""
    from specprefill_lab.bench import parse_server_timing

    samples: list[SessionSample] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=256)) as client:

        async def one(session: Session) -> None:
            await asyncio.sleep(max(0.0, session.start_s - (time.perf_counter() - start)))
            for index, messages in enumerate(session.requests):
                if index:
                    await asyncio.sleep(session.think_s[index - 1])
                body = {"model": path.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                sample = SessionSample(rate, path.name, session.number, session.kind, index, None)
                try:
                    ttft, headers = await stream_ttft(
                        client, f"{path.url}/v1/chat/completions", body, path.headers, usage={}
                    )
                except Exception:  # counted as an error; the session goes on
                    samples.append(sample)
                    continue
                sample.ttft_s = ttft
                sample.plan = headers.get("x-specprefill-plan") if headers.get("x-specprefill-status") else None
                sample.timing_ms = parse_server_timing(headers.get("server-timing"))
                samples.append(sample)

        await asyncio.gather(*(one(s) for s in sessions))
    return samples


def summarize_sessions(samples: list[SessionSample]) -> dict:
    """Per rate: each path's TTFT p50, p90 and errors, each kind's median, and the gateway's ratios to direct;
    then the max-QPS objective and each path's highest rate within it; the share of the gateway's requests
    with a prediction whose predicted backend time was within 2x of the measured one."""
    rates = sorted({s.rate for s in samples})
    per_rate = []
    for rate in rates:
        entry: dict = {"rate": rate, "paths": {}}
        for path in ("gateway", "direct"):
            mine = [s for s in samples if s.rate == rate and s.path == path]
            ok = [s.ttft_s for s in mine if s.ttft_s is not None]
            if not ok:
                continue
            kinds = {
                kind: statistics.median(t)
                for kind in KINDS
                if (t := [s.ttft_s for s in mine if s.kind == kind and s.ttft_s is not None])
            }
            entry["paths"][path] = {
                "requests": len(mine),
                "errors": len(mine) - len(ok),
                "p50_s": percentile(ok, 0.5),
                "p90_s": percentile(ok, 0.9),
                "kinds": kinds,
            }
        if len(entry["paths"]) == 2:
            gateway, direct = entry["paths"]["gateway"], entry["paths"]["direct"]
            entry["ratios"] = {
                "p50": gateway["p50_s"] / direct["p50_s"],
                "p90": gateway["p90_s"] / direct["p90_s"],
                "kinds": {
                    k: gateway["kinds"][k] / direct["kinds"][k] for k in gateway["kinds"] if k in direct["kinds"]
                },
            }
        per_rate.append(entry)
    summary: dict = {"rates": per_rate}
    checks = [
        c
        for s in samples
        if s.path == "gateway"
        if (c := within_2x(s.timing_ms.get("predicted"), s.timing_ms.get("backend"))) is not None
    ]
    summary["predicted_within_2x"] = sum(checks) / len(checks) if checks else None
    if per_rate and "direct" in per_rate[0]["paths"]:
        objective = 2 * per_rate[0]["paths"]["direct"]["p90_s"]
        best = {}
        for path in ("gateway", "direct"):
            passing = [
                e["rate"]
                for e in per_rate
                if path in e["paths"] and e["paths"][path]["errors"] == 0 and e["paths"][path]["p90_s"] <= objective
            ]
            best[path] = max(passing) if passing else None
        summary["objective_s"] = objective
        summary["max_rate"] = best
        summary["max_rate_ratio"] = (best["gateway"] / best["direct"]) if best["gateway"] and best["direct"] else None
        summary["gateway_passes_highest_rate"] = best["gateway"] == rates[-1]
    return summary


def format_sessions(summary: dict) -> str:
    lines = [
        f"{'rate/s':>7} {'path':>8} {'requests':>8} {'errors':>6} {'p50 s':>7} {'p90 s':>7}  "
        + " ".join(f"{k:>8}" for k in KINDS)
    ]
    for entry in summary["rates"]:
        for path, p in entry["paths"].items():
            lines.append(
                f"{entry['rate']:>7g} {path:>8} {p['requests']:>8} {p['errors']:>6} {p['p50_s']:>7.3f} "
                f"{p['p90_s']:>7.3f}  " + " ".join(f"{p['kinds'].get(k, float('nan')):>8.3f}" for k in KINDS)
            )
        if "ratios" in entry:
            r = entry["ratios"]
            lines.append(
                f"{entry['rate']:>7g} {'gw/dir':>8} {'':>8} {'':>6} {r['p50']:>7.2f} {r['p90']:>7.2f}  "
                + " ".join(f"{r['kinds'].get(k, float('nan')):>8.2f}" for k in KINDS)
            )
    if "objective_s" in summary:
        best = summary["max_rate"]
        lines.append(
            f"max rate with p90 TTFT <= {summary['objective_s']:.2f} s (twice direct's p90 at the lowest "
            f"rate): gateway {best['gateway']}, direct {best['direct']}, ratio {summary['max_rate_ratio']}"
            + (
                " (the gateway met it at the highest rate tried: a lower bound)"
                if summary.get("gateway_passes_highest_rate")
                else ""
            )
        )
    if summary.get("predicted_within_2x") is not None:
        lines.append(
            f"predicted backend time within 2x of the measured: {summary['predicted_within_2x']:.0%} "
            "of the gateway's requests"
        )
    return "\n".join(lines)


def as_dicts(samples: list[SessionSample]) -> list[dict]:
    return [asdict(s) for s in samples]

"""Real traffic, replayed: ``specprefill bench trace FILE``.

A Mooncake trace (kvcache-ai/Mooncake, ``FAST25-release/traces/*.jsonl``, from the FAST '25 paper; Apache-2.0)
gives, per request, its arrival (``timestamp``, ms), its ``input_length`` and ``output_length`` in tokens, and
the hash IDs of its prompt's 512-token blocks: requests that share a prefix share leading hash IDs. Replayed
here, each hash ID becomes a block of text that is the same wherever the ID appears (so a shared prefix is
shared text, and an engine's prefix cache sees what production's saw), scaled to this machine by two factors:
``block_tokens`` (tokens per block, for the trace's 512) and ``clock`` (the trace's time runs ``clock`` times
faster). Output lengths are kept, capped at ``max_output``. Both paths get the same schedule, each on its own
engine; requests are sent at their times whatever is still running (open loop: traffic does not wait).

Per request: TTFT and end-to-end time, the plan, the backend time predicted and measured, the cached tokens
predicted and reported. Per path: TTFT p50/p90/p99, split by how much of the prompt the trace says was seen
before (its blocks in an earlier request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from specprefill_lab.bench import PromptMaker, parse_server_timing, predicted_cached
from specprefill_lab.workloads import PathTarget, percentile

TRACE_BLOCK = 512  # tokens per hash ID in Mooncake's traces
SEEN_BUCKETS = ((0.0, 0.1, "cold"), (0.1, 0.8, "partly seen"), (0.8, 1.01, "mostly seen"))
FORMATS = "Mooncake's JSONL (timestamp ms, input_length, output_length, hash_ids)"


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # at the trace's own clock
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """A trace in Mooncake's format, in arrival order (the first ``limit`` requests); a line that is not one is
    an error naming it."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            request = TraceRequest(
                row["timestamp"] / 1e3, int(row["input_length"]), int(row["output_length"]), tuple(row["hash_ids"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number} is not a trace request in {FORMATS}: {exc}") from None
        requests.append(request)
        if limit is not None and len(requests) >= limit:
            break
    return sorted(requests, key=lambda r: r.arrival_s)


def conversations(requests: list[TraceRequest]) -> list[int]:
    """Per request, the number of its conversation: the earliest request whose second block it shares (every
    request in Mooncake's traces begins with the same block 0, and a conversation's next turn repeats its earlier
    turns' blocks). A request of one block is a conversation of its own."""
    first: dict[int, int] = {}
    out = []
    for number, request in enumerate(requests):
        key = request.hash_ids[1] if len(request.hash_ids) > 1 else None
        if key is None:
            out.append(number)
            continue
        out.append(first.setdefault(key, number))
    return out


def select(
    requests: list[TraceRequest], *, seconds: float | None = None, every: int = 1, limit: int | None = None
) -> list[TraceRequest]:
    """A trace cut to this machine without breaking its conversations: the requests of its first ``seconds``,
    one conversation in ``every`` (whole: every turn of a conversation kept, so what recurs still recurs), then
    the first ``limit`` of those."""
    if seconds is not None and requests:
        requests = [r for r in requests if r.arrival_s - requests[0].arrival_s < seconds]
    if every > 1:
        order = {c: i for i, c in enumerate(dict.fromkeys(conversations(requests)))}
        requests = [r for r, c in zip(requests, conversations(requests)) if order[c] % every == 0]
    return requests[:limit] if limit is not None else requests


def seen_shares(requests: list[TraceRequest]) -> list[float]:
    """Per request, the share of its blocks that an earlier request had (what the trace says could be cached)."""
    seen: set[int] = set()
    shares = []
    for request in requests:
        ids = request.hash_ids
        shares.append(sum(1 for i in ids if i in seen) / max(1, len(ids)))
        seen.update(ids)
    return shares


@dataclass
class ReplayRequest:
    number: int
    send_s: float  # on the replay's clock
    messages: list[dict]
    max_tokens: int
    seen: float  # the share of its blocks seen before


def replay_schedule(
    requests: list[TraceRequest], prompts: PromptMaker, *, block_tokens: int, clock: float, max_output: int
) -> list[ReplayRequest]:
    """The trace as chat requests: each hash ID one block of ``block_tokens`` tokens of text (made once), the
    last block cut to the request's length; times divided by ``clock``."""
    blocks: dict[int, str] = {}
    out = []
    start = requests[0].arrival_s if requests else 0.0
    for number, (request, seen) in enumerate(zip(requests, seen_shares(requests))):
        parts = []
        for i, hash_id in enumerate(request.hash_ids):
            if hash_id not in blocks:
                blocks[hash_id] = prompts.text(block_tokens)
            text = blocks[hash_id]
            if i == len(request.hash_ids) - 1:  # the last block holds what is left of the request's length
                left = request.input_tokens - TRACE_BLOCK * (len(request.hash_ids) - 1)
                text = text[: max(1, int(len(text) * min(1.0, max(left, 1) / TRACE_BLOCK)))]
            parts.append(text)
        messages = [{"role": "user", "content": " ".join(parts)}]
        max_tokens = max(1, min(max_output, request.output_tokens))
        out.append(ReplayRequest(number, (request.arrival_s - start) / clock, messages, max_tokens, seen))
    return out


@dataclass
class ReplaySample:
    path: str
    number: int
    send_s: float
    seen: float
    ttft_s: float | None = None  # None: failed
    e2e_s: float | None = None
    plan: str | None = None
    predicted_ms: float | None = None
    backend_ms: float | None = None
    predicted_cached: int | None = None
    reported_cached: int | None = None
    prompt_tokens: int | None = None
    error: str = ""


@dataclass(frozen=True)
class Foreign:
    """A second client sending its own long prompts straight to a path's engine: ``tokens`` random token IDs
    (one answer token) every ``every_s`` seconds from the replay's start until its last request is answered, the
    same prompts at the same times for both paths."""

    tokens: int
    every_s: float
    seed: int = 0

    async def run(self, client: httpx.AsyncClient, engine_url: str, model: str, done: asyncio.Event) -> int:
        """Sends until ``done``; how many prompts it sent."""
        rng, tasks = random.Random(self.seed), []
        while not done.is_set():
            prompt = [rng.randrange(100, 4000) for _ in range(self.tokens)]
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            # open loop, as traffic: each prompt goes at its time whatever is still running
            tasks.append(asyncio.ensure_future(client.post(f"{engine_url}/v1/completions", json=body)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), self.every_s)
        for task in tasks:
            task.cancel()  # the replay is over: what is still at the engine does not matter now
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)


async def replay(
    path: PathTarget, schedule: list[ReplayRequest], foreign: Foreign | None = None, engine_model: str | None = None
) -> tuple[list[ReplaySample], int]:
    """Every request of ``schedule`` through ``path`` at its time (open loop), streamed and read to its end; with
    ``foreign``, a second client's prompts at ``path``'s engine meanwhile (``engine_model``: its model's name).
    The samples, and how many prompts the second client sent."""
    samples = [ReplaySample(path.name, r.number, r.send_s, r.seen) for r in schedule]
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def one(request: ReplayRequest, sample: ReplaySample) -> None:
            await asyncio.sleep(max(0.0, request.send_s - (time.perf_counter() - start)))
            body = {
                "model": path.model,
                "messages": request.messages,
                "max_tokens": request.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            sent = time.perf_counter()
            try:
                async with client.stream(
                    "POST", f"{path.url}/v1/chat/completions", json=body, headers=path.headers
                ) as response:
                    if response.status_code != 200:
                        sample.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                        return
                    headers, usage = response.headers, {}
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if sample.ttft_s is None and event.get("choices"):
                            sample.ttft_s = time.perf_counter() - sent
                        usage = event.get("usage") or usage
                sample.e2e_s = time.perf_counter() - sent
            except httpx.HTTPError as exc:
                sample.error = type(exc).__name__
                return
            timing = parse_server_timing(headers.get("server-timing"))
            sample.plan = headers.get("x-specprefill-plan")
            sample.predicted_ms, sample.backend_ms = timing.get("predicted"), timing.get("backend")
            sample.predicted_cached = predicted_cached(headers.get("server-timing"))
            sample.prompt_tokens = usage.get("prompt_tokens")
            sample.reported_cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")

        done = asyncio.Event()
        second = None
        if foreign is not None and path.engine_url is not None:
            second = asyncio.ensure_future(foreign.run(client, path.engine_url, engine_model or path.model, done))
        await asyncio.gather(*(one(r, s) for r, s in zip(schedule, samples)))
        done.set()
        sent = await second if second is not None else 0
    return samples, sent


@dataclass
class TraceReport:
    meta: dict
    samples: list[ReplaySample] = field(default_factory=list)

    def summary(self) -> dict:
        """TTFT p50/p90/p99 per path, overall and by how much of the prompt was seen before; the gateway's over
        direct's at each; the plans the gateway chose."""
        out: dict = {"paths": {}, "plans": {}}
        for path in ("gateway", "direct"):
            mine = [s for s in self.samples if s.path == path]
            out["paths"][path] = {"requests": len(mine), "failed": sum(1 for s in mine if s.ttft_s is None)}
            groups = {
                "all": mine,
                **{name: [s for s in mine if low <= s.seen < high] for low, high, name in SEEN_BUCKETS},
            }
            for group, members in groups.items():
                ttfts = [s.ttft_s for s in members if s.ttft_s is not None]
                if ttfts:
                    out["paths"][path][group] = {
                        "n": len(ttfts),
                        **{f"p{q}": round(percentile(ttfts, q / 100), 3) for q in (50, 90, 99)},
                    }
        gateway, direct = out["paths"]["gateway"], out["paths"]["direct"]
        out["ratio"] = {
            group: {q: round(gateway[group][q] / direct[group][q], 3) for q in ("p50", "p90", "p99")}
            for group in ("all", *(name for _, _, name in SEEN_BUCKETS))
            if group in gateway and group in direct and all(direct[group][q] > 0 for q in ("p50", "p90", "p99"))
        }
        for s in self.samples:
            if s.path == "gateway" and s.plan:
                out["plans"][s.plan] = out["plans"].get(s.plan, 0) + 1
        ratios = [
            s.predicted_ms / s.backend_ms
            for s in self.samples
            if s.path == "gateway" and s.predicted_ms and s.backend_ms
        ]
        out["predicted_within_2x"] = {"n": len(ratios), "within": sum(1 for r in ratios if 0.5 <= r <= 2.0)}
        return out

    def write(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "trace.json"
        path.write_text(
            json.dumps(
                {"meta": self.meta, "summary": self.summary(), "samples": [asdict(s) for s in self.samples]}, indent=1
            )
        )
        return path


def _capacity(p90s: dict[float, float | None], slo_s: float) -> tuple[float | None, float | None]:
    """Where a path's capacity lies on the clocks tried: the fastest clock whose p90 met the objective (None: none
    did) and the next clock tried above it (None: none was), so that its capacity is in [low, high)."""
    under = [clock for clock, p90 in p90s.items() if p90 is not None and p90 <= slo_s]
    low = max(under) if under else None
    above = [clock for clock in p90s if low is None or clock > low]
    return low, (min(above) if above else None)


def max_qps(runs: dict[float, dict], slo_s: float) -> dict:
    """From one replay's summary per clock factor: the fastest clock at which each path's p90 TTFT stays under
    ``slo_s`` with no request failed (how much traffic it serves within the objective), and the gateway's over
    direct's. Each path's capacity lies between the fastest clock it met and the next one tried, so the ratio is
    given as the range those bracket (``ratio_range``: [lowest, highest], None where unbounded above) beside the
    ratio of the clocks met (``ratio``, None where a path met none): a claim reads the range's low end."""
    out: dict = {"slo_s": slo_s, "p90": {}, "max_clock": {}}
    bracket = {}
    for path in ("gateway", "direct"):
        p90s = {}
        for clock, summary in sorted(runs.items()):
            stats = summary["paths"][path]
            p90s[clock] = stats["all"]["p90"] if "all" in stats and not stats["failed"] else None
        out["p90"][path] = p90s
        bracket[path] = _capacity(p90s, slo_s)
        out["max_clock"][path] = bracket[path][0]
    (g_low, g_high), (d_low, d_high) = bracket["gateway"], bracket["direct"]
    out["ratio"] = round(g_low / d_low, 3) if g_low is not None and d_low is not None else None
    lowest = round(g_low / d_high, 3) if g_low is not None and d_high is not None else 0.0
    highest = round(g_high / d_low, 3) if g_high is not None and d_low is not None else None
    out["ratio_range"] = [lowest, highest]
    return out


def format_trace(summary: dict) -> str:
    lines = [
        f"{'path':>8} {'requests':>9} {'failed':>7} {'prompts':>12} {'n':>4} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7}"
    ]
    for path, stats in summary["paths"].items():
        for group in ("all", *(name for _, _, name in SEEN_BUCKETS)):
            if group in stats:
                g = stats[group]
                lines.append(
                    f"{path:>8} {stats['requests']:>9} {stats['failed']:>7} {group:>12} {g['n']:>4} "
                    f"{g['p50']:>7.2f} {g['p90']:>7.2f} {g['p99']:>7.2f}"
                )
    for group, ratio in summary["ratio"].items():
        lines.append(f"gateway / direct, {group}: p50 {ratio['p50']}, p90 {ratio['p90']}, p99 {ratio['p99']}")
    lines.append(f"the gateway's plans: {summary['plans']}")
    if "predicted_within_2x" in summary:
        within = summary["predicted_within_2x"]
        lines.append(f"backend time predicted within 2x: {within['within']} of {within['n']} requests")
    return "\n".join(lines)


def plot_trace(report: dict, png: Path) -> Path:
    """TTFT against each request's send time, both paths, one point a request (the trace's ``trace.json``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for path, marker in (("direct", "o"), ("gateway", "s")):
        mine = [s for s in report["samples"] if s["path"] == path and s["ttft_s"] is not None]
        ax.scatter([s["send_s"] for s in mine], [s["ttft_s"] for s in mine], label=path, marker=marker, s=18)
    meta = report["meta"]
    ax.set_xlabel("sent at (s, the replay's clock)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(
        f"{meta['requests']} requests of {Path(meta['trace']).name}, {meta['block_tokens']} tokens a block, "
        f"clock x{meta['clock']:g}, {meta['engine']} engine",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png

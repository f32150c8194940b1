"""The workload bench: request sequences that repeat context, through the gateway and directly, request by request.

Each workload is a sequence of chat requests, as clients send them:
  fresh         a new document with each request (nothing repeats)
  document      one document, a new question with each request (separate requests)
  chat          a multi-turn chat over a document: each turn adds the previous answer and a new question
  agent         an agent loop: each step adds a tool call and its output (``step_tokens`` tokens)
  system        one long system prompt shared by users who each ask a short question
  agent-messages  an agent loop in Anthropic's Messages form, as Claude Code sends it: a long system prompt
                and tool definitions, then a transcript of ``tool_use`` / ``tool_result`` turns growing every
                step, to ``/v1/messages`` (vLLM's own, directly)
  foreign       a chat whose engine also serves another client: before each later turn, that client's long
                prompts go straight to the engine and evict blocks (``ACTIONS``)
  restart       a chat whose engine restarts halfway (its cache empty), where the bench launched the engines
  kill          a chat over replicas whose replica (the one that served the last turn) is killed halfway, for
                good: the next turns go to another (``--replicas``)
The gateway and the direct path each talk to their own instance of the same engine, so neither warms the
other's prefix cache. How requests follow each other is the arrival mode (``MODES``):
  back-to-back  the next request leaves the moment the previous answer ends (an agent whose tool returned)
  think         the next request leaves ``think_s`` after the previous answer ends (a user who reads, then asks)
  idle          before each request the bench waits until the engines and the gateway are idle, warming
                included: a user who always waits long enough. It never lets background work meet a request,
                so it is the one mode that flatters warming; it is kept, labelled, for comparison.
In back-to-back and think modes each path sends its whole sequence (every workload in turn, with no wait between
them) on its own, one path after the other, and the bench waits for idle only between the two paths: the
boundary between the two systems under test. On a shared machine (2 cores here) the engines share the CPU, so
one path's background work would otherwise land in the other's timings. In idle mode the two paths alternate
request by request (which goes first alternating too), as the waits keep them apart.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from specprefill_lab.bench import PromptMaker, parse_server_timing, predicted_cached, stream_ttft, wait_idle
from specprefill_lab.engine_metrics import EngineQueue

MODES = ("back-to-back", "think", "idle")
WORKLOADS = ("fresh", "document", "chat", "agent", "system", "agent-messages")
EXTRA_WORKLOADS = ("foreign", "restart", "kill")  # not among the defaults: they disturb the engine on purpose
ACTIONS = ("foreign", "restart", "kill")  # what happens at a path's engine before a request (``Workload.before``)
AGENT_TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    {
        "name": "run_tests",
        "description": "Run the test suite and return its output.",
        "input_schema": {"type": "object", "properties": {"selector": {"type": "string"}}},
    },
]


@dataclass
class Workload:
    name: str
    requests: list  # each request's chat messages, in order (Messages API: each request's body fields)
    api: str = "chat"  # "chat" (OpenAI's chat completions) or "messages" (Anthropic's)
    before: dict[int, str] = field(default_factory=dict)  # request index -> an action at the engine first


def build_workloads(
    prompts: PromptMaker, names: list[str], n_requests: int, tokens: int, step_tokens: int
) -> list[Workload]:
    """The named workloads, each of ``n_requests`` requests whose prompts hold ``tokens`` tokens or more."""
    questions = [
        f"\n\nQuestion {i + 1}: which number appears in sentence {3 * i + 2} of the text above?"
        for i in range(n_requests)
    ]
    builders = {
        "fresh": lambda: [[{"role": "user", "content": prompts.text(tokens) + q}] for q in questions],
        "document": lambda: _one_document(prompts.text(tokens), questions),
        "chat": lambda: _chat(prompts.text(tokens), questions),
        "agent": lambda: _agent(prompts, tokens, step_tokens, n_requests),
        "system": lambda: [
            [{"role": "system", "content": system}, {"role": "user", "content": q.strip()}]
            for system in [prompts.text(tokens)]
            for q in questions
        ],
        "agent-messages": lambda: _agent_messages(prompts, tokens, step_tokens, n_requests),
        "foreign": lambda: _chat(prompts.text(tokens), questions),
        "restart": lambda: _chat(prompts.text(tokens), questions),
        "kill": lambda: _chat(prompts.text(tokens), questions),
    }
    before = {
        "foreign": {i: "foreign" for i in range(1, n_requests)},
        "restart": {n_requests // 2: "restart"},
        "kill": {n_requests // 2: "kill"},
    }
    return [
        Workload(name, builders[name](), "messages" if name == "agent-messages" else "chat", before.get(name, {}))
        for name in names
    ]


def _one_document(document: str, questions: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": document + q}] for q in questions]


def _chat(document: str, questions: list[str]) -> list[list[dict]]:
    turns, messages = [], [{"role": "user", "content": document + questions[0]}]
    for i, question in enumerate(questions):
        if i:
            messages = messages + [
                {"role": "assistant", "content": f"The number in sentence {3 * i - 1} is {i * 7}."},
                {"role": "user", "content": question.strip()},
            ]
        turns.append(messages)
    return turns


def _agent(prompts: PromptMaker, tokens: int, step_tokens: int, n_requests: int) -> list[list[dict]]:
    messages = [
        {"role": "system", "content": "You are an agent. Call a tool, read its output, then decide."},
        {"role": "user", "content": "Task: summarise these files.\n\n" + prompts.text(tokens)},
    ]
    steps = []
    for i in range(n_requests):
        if i:
            messages = messages + [
                {"role": "assistant", "content": f'{{"tool": "read_file", "args": {{"n": {i}}}}}'},
                {"role": "tool", "content": prompts.text(step_tokens)},
            ]
        steps.append(messages)
    return steps


def _agent_messages(prompts: PromptMaker, tokens: int, step_tokens: int, n_requests: int) -> list[dict]:
    """Claude Code's shape: instructions in a long system prompt (half the tokens) with the tools, the task with
    its context (the other half), then one ``tool_use`` and its ``tool_result`` more every step."""
    system = [
        {
            "type": "text",
            "text": "You are a coding agent. Use the tools, read their output, then decide.\n\n"
            + prompts.text(tokens // 2),
            "cache_control": {"type": "ephemeral"},
        }
    ]
    messages: list[dict] = [{"role": "user", "content": "Task: fix the failing test.\n\n" + prompts.text(tokens // 2)}]
    steps = []
    for i in range(n_requests):
        if i:
            call = {"type": "tool_use", "id": f"toolu_{i:02d}", "name": "read_file", "input": {"path": f"src/m{i}.py"}}
            result = {
                "type": "tool_result",
                "tool_use_id": call["id"],
                "content": [{"type": "text", "text": prompts.text(step_tokens)}],
            }
            messages = messages + [
                {"role": "assistant", "content": [{"type": "text", "text": "Reading it."}, call]},
                {"role": "user", "content": [result]},
            ]
        steps.append({"system": system, "tools": AGENT_TOOLS, "messages": messages})
    return steps


@dataclass
class WorkloadSample:
    workload: str
    index: int
    path: str  # "gateway" or "direct"
    ttft_s: float
    prompt_tokens: int | None = None
    kept_tokens: int | None = None
    status: str | None = None
    plan: str | None = None
    reason: str | None = None
    timing_ms: dict[str, float] = field(default_factory=dict)
    cached_tokens: int | None = None  # prompt tokens the engine served from its prefix cache (its usage)
    predicted_cached: int | None = None  # what the gateway's plan predicted for that
    mode: str = "idle"
    at_s: float = 0.0  # when it was sent, from the start of its path's run
    queue_s: float | None = None  # the engine's queue time over this request (its requests that ended meanwhile)
    queued: int | None = None  # how many requests that queue time covers (a warm's pieces too)
    replica: int | None = None  # which replica served it (the gateway's Server-Timing, the router's x-replica)


@dataclass
class PathTarget:
    """One path of the comparison: where its requests go, and the engine behind it (for its queue time)."""

    name: str  # "gateway" or "direct"
    url: str
    model: str
    headers: dict[str, str]
    engine_url: str | None = None


async def run_workloads(
    mode: str,
    workloads: dict[str, list[Workload]],
    paths: list[PathTarget],
    idle_urls: list[str],
    *,
    think_s: float = 1.0,
    max_tokens: int = 1,
    first: str = "gateway",
    act: Callable[[str, PathTarget, WorkloadSample | None], Awaitable[None]] | None = None,
) -> list[WorkloadSample]:
    """Every workload through each path in arrival ``mode``; ``workloads[path.name]`` are that path's (the
    direct path may get the same workloads over other documents, when both share one engine). ``act(action,
    path, last)`` does a workload's actions at the path's engine (``Workload.before``; ``last``: the path's
    previous answer), before the request and outside its time."""
    last: dict[str, WorkloadSample] = {}

    async def send(path: PathTarget, workload: Workload, index: int, at_s: float) -> WorkloadSample:
        if index in workload.before:
            if act is None:
                raise ValueError(
                    f"workload {workload.name!r} needs its engine {workload.before[index]} here, "
                    "which only a launched stack can do"
                )
            await act(workload.before[index], path, last.get(path.name))
        sample = last[path.name] = await _send(
            client, path, queues[path.name], workload, index, workload.requests[index], mode, max_tokens, at_s
        )
        return sample

    if mode not in MODES:
        raise ValueError(f"arrival mode {mode!r}: one of {', '.join(MODES)}")
    samples: list[WorkloadSample] = []
    total = sum(len(w.requests) for w in workloads[paths[0].name])
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        queues = {p.name: EngineQueue(client, p.engine_url) for p in paths}
        for queue in queues.values():
            await queue.read()
        if mode == "idle":
            progress = tqdm(total=total, desc=f"workloads, {mode}", unit="request")
            for number, workload in enumerate(workloads[paths[0].name]):
                for index in range(len(workload.requests)):
                    for path in paths if index % 2 == 0 else paths[::-1]:
                        await wait_idle(client, idle_urls)
                        samples.append(await send(path, workloads[path.name][number], index, 0.0))
                    progress.update(1)
            progress.close()
            return samples
        for path in sorted(paths, key=lambda p: p.name != first):
            await wait_idle(client, idle_urls)  # between the two systems under test, never inside one's run
            await queues[path.name].read()
            start = time.perf_counter()
            for workload in tqdm(workloads[path.name], desc=f"workloads, {mode}, {path.name}", unit="workload"):
                for index in range(len(workload.requests)):
                    if mode == "think" and (index or workload is not workloads[path.name][0]):
                        await asyncio.sleep(think_s)
                    samples.append(await send(path, workload, index, time.perf_counter() - start))
    return samples


async def _send(
    client: httpx.AsyncClient,
    path: PathTarget,
    queue: EngineQueue,
    workload: Workload,
    index: int,
    request,
    mode: str,
    max_tokens: int,
    at_s: float,
) -> WorkloadSample:
    usage: dict = {}
    if workload.api == "messages":
        body = {"model": path.model, **request, "max_tokens": max_tokens, "temperature": 0}
        ttft, headers = await stream_ttft(client, f"{path.url}/v1/messages", body, path.headers, usage)
        cached = usage.get("cache_read_input_tokens")
    else:
        body = {"model": path.model, "messages": request, "max_tokens": max_tokens, "temperature": 0}
        ttft, headers = await stream_ttft(client, f"{path.url}/v1/chat/completions", body, path.headers, usage)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    sample = _sample(workload.name, index, path.name, ttft, headers)
    sample.cached_tokens, sample.predicted_cached = cached, predicted_cached(headers.get("server-timing"))
    sample.mode, sample.at_s = mode, at_s
    sample.queue_s, sample.queued = await queue.read()
    return sample


async def compare_engines(
    urls: dict[str, str], model: str, messages: list[dict], idle_urls: list[str], rounds: int = 8, max_tokens: int = 1
) -> dict:
    """The same requests sent directly to each path's engine, the order alternating: how far apart the two
    instances are on them. Their histories differ (the gateway's engine has also read the probe, compressed
    selections and warms), so on a request both hold whole, this is the part of the workloads' ratio that is
    not the gateway's. Each round's request ends in a new line of its own, as each workload request ends in
    a new question: the engines read the cached head and prefill a new tail."""
    seconds: dict[str, list[float]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        for i in range(rounds):
            order = list(urls.items())
            for name, url in order if i % 2 == 0 else order[::-1]:
                await wait_idle(client, idle_urls)
                tail = {**messages[-1], "content": f"{messages[-1]['content']}\nCheck {i}: answer in one word."}
                body = {"model": model, "messages": [*messages[:-1], tail], "max_tokens": max_tokens, "temperature": 0}
                ttft, _ = await stream_ttft(client, f"{url}/v1/chat/completions", body, {}, usage={})
                seconds[name].append(ttft)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    gateway_engine, direct_engine = medians.values()
    return {"seconds": seconds, "medians_s": medians, "ratio": gateway_engine / direct_engine}


def last_whole_request(workloads: list[Workload], samples: list[WorkloadSample]) -> list[dict] | None:
    """The messages of the last request the gateway sent whole (both engines then hold the same tokens)."""
    requests = {w.name: w.requests for w in workloads if w.api == "chat"}
    for sample in reversed(samples):
        if sample.path == "gateway" and sample.status == "bypassed" and sample.workload in requests:
            return requests[sample.workload][sample.index]
    return None


def _sample(workload: str, index: int, path: str, ttft: float, headers: httpx.Headers) -> WorkloadSample:
    def number(name: str) -> int | None:
        return int(headers[name]) if name in headers else None

    replica = re.search(r'replica;desc="(\d+)"', headers.get("server-timing") or "")
    return WorkloadSample(
        workload,
        index,
        path,
        ttft,
        number("x-specprefill-original-tokens"),
        number("x-specprefill-kept-tokens"),
        headers.get("x-specprefill-status"),
        headers.get("x-specprefill-plan"),
        headers.get("x-specprefill-reason"),
        parse_server_timing(headers.get("server-timing")),
        replica=int(replica.group(1)) if replica else number("x-replica"),
    )


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile, interpolated between the nearest ranks (numpy's default): the 90th percentile of
    six requests lies between the fifth and the sixth, not at the worst."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def within_2x(predicted_ms: float | None, measured_ms: float | None) -> bool | None:
    """Whether the plan's predicted backend time is within a factor of 2 of the measured one (None: unknown)."""
    if predicted_ms is None or measured_ms is None or measured_ms <= 0:
        return None
    return 0.5 <= max(predicted_ms, 1e-3) / measured_ms <= 2.0


def summarize_workloads(samples: list[WorkloadSample]) -> list[dict]:
    """Per workload and request: both TTFTs, their ratio, and what the gateway did (its plan, predicted and
    measured backend time, the wait it predicted, the time it spent beside the gateway's own background work,
    the engine's queue time); per workload, the first request's ratio and the later requests' median, 90th
    percentile and worst. ``samples`` are one arrival mode's."""
    rows = []
    for name in dict.fromkeys(s.workload for s in samples):
        pairs = {}
        for s in samples:
            if s.workload == name:
                pairs.setdefault(s.index, {})[s.path] = s
        requests = []
        for index, pair in sorted(pairs.items()):
            gateway, direct = pair["gateway"], pair["direct"]
            timing = gateway.timing_ms
            requests.append(
                {
                    "index": index,
                    "tokens": gateway.prompt_tokens,
                    "kept": gateway.kept_tokens,
                    "direct_s": direct.ttft_s,
                    "gateway_s": gateway.ttft_s,
                    "ratio": gateway.ttft_s / direct.ttft_s,
                    "status": gateway.status,
                    "plan": gateway.plan or gateway.reason,
                    "timing_ms": timing,
                    "predicted_within_2x": within_2x(timing.get("predicted"), timing.get("backend")),
                    "behind_background_ms": timing.get("background"),
                    "queue_s": {"gateway": gateway.queue_s, "direct": direct.queue_s},
                    "cached": {
                        "gateway": gateway.cached_tokens,
                        "direct": direct.cached_tokens,
                        "predicted": gateway.predicted_cached,
                    },
                    "replica": {"gateway": gateway.replica, "direct": direct.replica},
                }
            )
        later = [r["ratio"] for r in requests[1:]] or [requests[0]["ratio"]]
        rows.append(
            {
                "workload": name,
                "requests": requests,
                "first_ratio": requests[0]["ratio"],
                "later_median_ratio": statistics.median(later),
                "later_p90_ratio": percentile(later, 0.9),
                "later_max_ratio": max(later),
            }
        )
    return rows


def prediction_share(rows: list[dict]) -> float | None:
    """The share of the gateway's requests whose predicted backend time was within 2x of the measured one."""
    checks = [r["predicted_within_2x"] for row in rows for r in row["requests"] if r["predicted_within_2x"] is not None]
    return sum(checks) / len(checks) if checks else None


def cache_prediction_share(rows: list[dict]) -> float | None:
    """The share of the gateway's requests whose predicted engine cache hit was the one the engine reported."""
    checks = [
        r["cached"]["predicted"] == r["cached"]["gateway"]
        for row in rows
        for r in row["requests"]
        if r["cached"].get("predicted") is not None and r["cached"].get("gateway") is not None
    ]
    return sum(checks) / len(checks) if checks else None


def _count(value: int | float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_workloads(rows: list[dict]) -> str:
    lines = [
        f"{'workload':>9} {'req':>3} {'tokens':>7} {'kept':>6} {'direct s':>9} {'gateway s':>10} "
        f"{'gw/direct':>9} {'cached gw':>9} {'direct':>6} {'pred ms':>8} {'backend':>8} {'behind':>7} "
        f"{'queue gw':>8} {'direct':>6} {'replica':>7}  plan"
    ]
    for row in rows:
        for r in row["requests"]:
            cached, timing, queue = r.get("cached") or {}, r.get("timing_ms") or {}, r.get("queue_s") or {}
            replica = "/".join("-" if x is None else str(x) for x in (r.get("replica") or {}).values())
            lines.append(
                f"{row['workload']:>9} {r['index'] + 1:>3} {r['tokens'] or 0:>7} {r['kept'] or 0:>6} "
                f"{r['direct_s']:>9.3f} {r['gateway_s']:>10.3f} {r['ratio']:>9.2f} "
                f"{_count(cached.get('gateway')):>9} {_count(cached.get('direct')):>6} "
                f"{_count(timing.get('predicted')):>8} {_count(timing.get('backend')):>8} "
                f"{_count(timing.get('background')):>7} {_count(queue.get('gateway'), 3):>8} "
                f"{_count(queue.get('direct'), 3):>6} {replica or '':>7}  {r['plan'] or ''}"
            )
        lines.append(
            f"{row['workload']:>9}   first {row['first_ratio']:.2f}, later: median "
            f"{row['later_median_ratio']:.2f}, p90 {row['later_p90_ratio']:.2f}, "
            f"max {row['later_max_ratio']:.2f}"
        )
    share = prediction_share(rows)
    if share is not None:
        lines.append(f"predicted backend time within 2x of the measured: {share:.0%} of the gateway's requests")
    hits = cache_prediction_share(rows)
    if hits is not None:
        lines.append(f"predicted cached tokens equal to the engine's: {hits:.0%} of the gateway's requests")
    return "\n".join(lines)

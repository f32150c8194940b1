"""The workload bench: request sequences that repeat context, through the gateway and directly, request by request.

Each workload is a sequence of chat requests, as clients send them:
  fresh         a new document with each request (nothing repeats)
  document      one document, a new question with each request (separate requests)
  chat          a multi-turn chat over a document: each turn adds the previous answer and a new question
  agent         an agent loop: each step adds a tool call and its output (``step_tokens`` tokens)
  system        one long system prompt shared by users who each ask a short question
The gateway and the direct path each talk to their own instance of the same engine, so neither warms the
other's prefix cache. Before each request the bench waits until every engine and the gateway are idle (a
user's think time), so that on a shared machine no path's background work lands in the other's timing.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from specprefill.lab.bench import PromptMaker, parse_server_timing, stream_ttft, wait_idle

WORKLOADS = ("fresh", "document", "chat", "agent", "system")


@dataclass
class Workload:
    name: str
    requests: list[list[dict]]  # the messages of each request, in order


def build_workloads(prompts: PromptMaker, names: list[str], n_requests: int, tokens: int,
                    step_tokens: int) -> list[Workload]:
    """The named workloads, each of ``n_requests`` requests whose prompts hold ``tokens`` tokens or more."""
    questions = [f"\n\nQuestion {i + 1}: which number appears in sentence {3 * i + 2} of the text above?"
                 for i in range(n_requests)]
    builders = {
        "fresh": lambda: [[{"role": "user", "content": prompts.text(tokens) + q}] for q in questions],
        "document": lambda: _one_document(prompts.text(tokens), questions),
        "chat": lambda: _chat(prompts.text(tokens), questions),
        "agent": lambda: _agent(prompts, tokens, step_tokens, n_requests),
        "system": lambda: [[{"role": "system", "content": system}, {"role": "user", "content": q.strip()}]
                           for system in [prompts.text(tokens)] for q in questions],
    }
    return [Workload(name, builders[name]()) for name in names]


def _one_document(document: str, questions: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": document + q}] for q in questions]


def _chat(document: str, questions: list[str]) -> list[list[dict]]:
    turns, messages = [], [{"role": "user", "content": document + questions[0]}]
    for i, question in enumerate(questions):
        if i:
            messages = messages + [{"role": "assistant", "content": f"The number in sentence {3 * i - 1} is {i * 7}."},
                                   {"role": "user", "content": question.strip()}]
        turns.append(messages)
    return turns


def _agent(prompts: PromptMaker, tokens: int, step_tokens: int, n_requests: int) -> list[list[dict]]:
    messages = [{"role": "system", "content": "You are an agent. Call a tool, read its output, then decide."},
                {"role": "user", "content": "Task: summarise these files.\n\n" + prompts.text(tokens)}]
    steps = []
    for i in range(n_requests):
        if i:
            messages = messages + [{"role": "assistant", "content": f'{{"tool": "read_file", "args": {{"n": {i}}}}}'},
                                   {"role": "tool", "content": prompts.text(step_tokens)}]
        steps.append(messages)
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


async def run_workloads(workloads: list[Workload], gateway: tuple[str, str], direct: tuple[str, str],
                        idle_urls: list[str], headers: dict[str, str], max_tokens: int = 1,
                        direct_workloads: list[Workload] | None = None) -> list[WorkloadSample]:
    """Each request through the gateway and directly, (base URL, model) for each path; which goes first
    alternates from one request to the next, so that neither path always runs right after the other's
    request (a CPU, its caches and the engines' threads warm from it) or right after the idle wait. With
    ``direct_workloads`` (the same workloads over other documents) the direct path sends those: both paths
    can then share one engine without either warming the other's cache."""
    samples = []
    total = sum(len(w.requests) for w in workloads)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        progress = tqdm(total=total, desc="workloads", unit="request")
        for number, workload in enumerate(workloads):
            mirror = (direct_workloads or workloads)[number]
            for index, messages in enumerate(workload.requests):
                paths = (("gateway", gateway, headers, messages), ("direct", direct, {}, mirror.requests[index]))
                for path, (url, model), extra, messages in paths if index % 2 == 0 else paths[::-1]:
                    await wait_idle(client, idle_urls)
                    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
                    usage: dict = {}
                    ttft, answer_headers = await stream_ttft(client, f"{url}/v1/chat/completions", body, extra, usage)
                    sample = _sample(workload.name, index, path, ttft, answer_headers)
                    sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    samples.append(sample)
                progress.update(1)
        progress.close()
    return samples


async def compare_engines(urls: dict[str, str], model: str, messages: list[dict], idle_urls: list[str],
                          rounds: int = 8, max_tokens: int = 1) -> dict:
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
                body = {"model": model, "messages": [*messages[:-1], tail], "max_tokens": max_tokens,
                        "temperature": 0}
                ttft, _ = await stream_ttft(client, f"{url}/v1/chat/completions", body, {}, usage={})
                seconds[name].append(ttft)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    gateway_engine, direct_engine = medians.values()
    return {"seconds": seconds, "medians_s": medians, "ratio": gateway_engine / direct_engine}


def last_whole_request(workloads: list[Workload], samples: list[WorkloadSample]) -> list[dict] | None:
    """The messages of the last request the gateway sent whole (both engines then hold the same tokens)."""
    requests = {w.name: w.requests for w in workloads}
    for sample in reversed(samples):
        if sample.path == "gateway" and sample.status == "bypassed":
            return requests[sample.workload][sample.index]
    return None


def _sample(workload: str, index: int, path: str, ttft: float, headers: httpx.Headers) -> WorkloadSample:
    def number(name: str) -> int | None:
        return int(headers[name]) if name in headers else None

    return WorkloadSample(workload, index, path, ttft, number("x-specprefill-original-tokens"),
                          number("x-specprefill-kept-tokens"), headers.get("x-specprefill-status"),
                          headers.get("x-specprefill-plan"), headers.get("x-specprefill-reason"),
                          parse_server_timing(headers.get("server-timing")))


def summarize_workloads(samples: list[WorkloadSample]) -> list[dict]:
    """Per workload and request: both TTFTs, their ratio, and what the gateway did; per workload, the medians."""
    rows = []
    for name in dict.fromkeys(s.workload for s in samples):
        pairs = {}
        for s in samples:
            if s.workload == name:
                pairs.setdefault(s.index, {})[s.path] = s
        requests = []
        for index, pair in sorted(pairs.items()):
            gateway, direct = pair["gateway"], pair["direct"]
            requests.append({"index": index, "tokens": gateway.prompt_tokens, "kept": gateway.kept_tokens,
                             "direct_s": direct.ttft_s, "gateway_s": gateway.ttft_s,
                             "ratio": gateway.ttft_s / direct.ttft_s, "status": gateway.status,
                             "plan": gateway.plan or gateway.reason, "timing_ms": gateway.timing_ms,
                             "cached": {"gateway": gateway.cached_tokens, "direct": direct.cached_tokens}})
        later = [r["ratio"] for r in requests[1:]] or [requests[0]["ratio"]]
        rows.append({"workload": name, "requests": requests, "first_ratio": requests[0]["ratio"],
                     "later_median_ratio": statistics.median(later), "later_max_ratio": max(later)})
    return rows


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def format_workloads(rows: list[dict]) -> str:
    lines = [f"{'workload':>9} {'req':>3} {'tokens':>7} {'kept':>6} {'direct s':>9} {'gateway s':>10} "
             f"{'gw/direct':>9} {'cached gw':>9} {'direct':>6}  plan"]
    for row in rows:
        for r in row["requests"]:
            cached = r.get("cached") or {}
            lines.append(f"{row['workload']:>9} {r['index'] + 1:>3} {r['tokens'] or 0:>7} {r['kept'] or 0:>6} "
                         f"{r['direct_s']:>9.3f} {r['gateway_s']:>10.3f} {r['ratio']:>9.2f} "
                         f"{_count(cached.get('gateway')):>9} {_count(cached.get('direct')):>6}  {r['plan'] or ''}")
        lines.append(f"{row['workload']:>9}   first {row['first_ratio']:.2f}, later: median "
                     f"{row['later_median_ratio']:.2f}, max {row['later_max_ratio']:.2f}")
    return "\n".join(lines)

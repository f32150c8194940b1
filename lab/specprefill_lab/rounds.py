"""Closed-loop load against a backend that answers at once: N streams of short chats, each sending its next
request when its answer ends, through the gateway and straight to the backend, in rounds against the same
processes. What it measures is the gateway's own cost, and whether that cost holds from one round to the next
(state that grows between rounds, collections, refits on every answer would show as later rounds slower).

Each round records, besides requests/s and TTFT, the CPU each process spent per request and the share of the
machine's time its hypervisor took (steal, from ``/proc/stat``): a round that served fewer requests at the same
CPU per request was starved of the cores, not slower at its work.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from common.process import rss_mib
from specprefill_lab.demo_models import ensure_demo_models
from specprefill_lab.launch import launched_bare_proxy, launched_gateway_process, launched_instant_backend
from specprefill_lab.load import percentile

BODY = {"messages": [{"role": "user", "content": "Hello there, how are you?"}], "max_tokens": 8, "stream": True}


@dataclass
class Round:
    path: str  # "direct", "gateway", "against" (another checkout's gateway) or "floor" (the bare proxy)
    requests: int
    errors: int
    seconds: float
    ttfts: list[float] = field(repr=False)
    error_reasons: dict[str, int]
    cpu_ms: dict[str, float] = field(default_factory=dict)  # per request, by process
    steal: float = 0.0  # share of the machine's CPU time the hypervisor took during the round
    gateway_rss_mib: float = 0.0  # the gateway's resident memory at the round's end

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def ms(self, q: float) -> float:
        return percentile(self.ttfts, q) * 1e3

    def summary(self) -> dict:
        return {
            "path": self.path,
            "requests": self.requests,
            "errors": self.errors,
            "rps": round(self.rps, 1),
            "p50_ms": round(self.ms(0.5), 2),
            "p99_ms": round(self.ms(0.99), 2),
            "mean_ms": round(statistics.fmean(self.ttfts) * 1e3, 2) if self.ttfts else None,
            "cpu_ms": {k: round(v, 3) for k, v in self.cpu_ms.items()},
            "steal": round(self.steal, 3),
            "gateway_rss_mib": round(self.gateway_rss_mib, 1),
            "error_reasons": self.error_reasons,
        }


@dataclass
class InstantStack:
    backend_url: str
    gateway_url: str
    pids: dict[str, int]  # "gateway", "backend", "against" where another checkout's gateway stands beside, "floor"
    against_url: str | None = None
    floor_url: str | None = None  # the bare proxy in front of the same backend

    def url(self, path: str) -> tuple[str, str]:
        """Where a round on ``path`` sends its requests, and the model it names."""
        if path == "direct":
            return self.backend_url, "fast"
        if path == "floor":
            return self.floor_url or "", "fast"
        return (self.against_url if path == "against" else self.gateway_url) or "", "demo"


@contextlib.contextmanager
def instant_stack(
    pin: bool = False, workers: int = 1, redis: bool = False, against: Path | None = None, floor: bool = False
) -> Iterator[InstantStack]:
    """The demo gateway in front of the instant backend. ``pin``: the gateway on one core, this process (the
    client) and the backend on the others. ``workers``: the gateway as that many worker processes on its port
    (``specprefill serve --workers``, sharing state through the Redis at ``SPECPREFILL_TEST_REDIS_URL``, or
    the local one; ``redis``: one worker with it too); every number of the gateway's is then summed over its
    parent and workers. ``against``: another checkout's gateway too, the same arguments, in front of the same
    backend (path "against"), so that two versions are measured at the machine's same speed. ``floor``: the bare
    proxy too (``specprefill_lab.bare_proxy``, path "floor"): the least a proxy of the same parts costs."""
    root = ensure_demo_models()
    args = [
        "--backend-url",
        "",  # the backend's, below
        "--backend-model",
        "fast",
        "--target-model",
        str(root / "target"),
        "--draft-model",
        str(root / "draft"),
        "--served-model-name",
        "demo",
    ]
    if workers > 1 or redis:
        args += ["--redis-url", os.environ.get("SPECPREFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")]
    if workers > 1:
        args += ["--workers", str(workers)]
    with launched_instant_backend() as (backend_url, backend):
        args[1] = backend_url
        with contextlib.ExitStack() as gateways:
            gateway_url, gateway = gateways.enter_context(launched_gateway_process(args))
            pids = {"gateway": gateway.pid, "backend": backend.pid}
            against_url = None
            if against is not None:
                against_url, other = gateways.enter_context(launched_gateway_process(args, against))
                pids["against"] = other.pid
            floor_url = None
            if floor:
                floor_url, bare = gateways.enter_context(launched_bare_proxy(backend_url))
                pids["floor"] = bare.pid
            for name in ("gateway", "against"):
                if workers > 1 and name in pids:
                    _until_workers_serve(pids[name], workers)
            if pin:
                cores = sorted(os.sched_getaffinity(0))
                proxies = [pids[name] for name in ("gateway", "against", "floor") if name in pids]
                for pid in [each for proxy in proxies for each in tree(proxy)]:
                    os.sched_setaffinity(pid, cores[:1])
                for pid in (0, backend.pid):
                    os.sched_setaffinity(pid, cores[1:] or cores)
            yield InstantStack(backend_url, gateway_url, pids, against_url, floor_url)


def _until_workers_serve(parent: int, count: int, timeout: float = 300.0) -> None:
    """Waits until ``parent`` has ``count`` workers and the last has finished starting (its CPU use stalls: the
    supervisor starts each worker once the one before serves, so only the last can still be loading)."""
    deadline = time.monotonic() + timeout
    while len(children := _workers(parent)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(children)} of {count} gateway workers started in {timeout:.0f} s")
        time.sleep(0.2)
    last, used = max(children), -1.0
    while (now := cpu_seconds(last)) != used and time.monotonic() < deadline:
        used = now
        time.sleep(1.0)


def _workers(parent: int) -> list[int]:
    """The gateway's worker processes (multiprocessing's spawned children; not its resource tracker)."""
    found = []
    for pid in tree(parent)[1:]:
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants, alive now (from ``/proc``)."""
    found, index = [pid], 0
    while index < len(found):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{found[index]}/task").iterdir():
                found += [int(c) for c in (task / "children").read_text().split()]
        index += 1
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds the process has used, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds ``pid`` and its descendants have used (a gateway's workers with it)."""
    total = 0.0
    for each in tree(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(each)
    return total


def tree_rss_mib(pid: int) -> float:
    """The resident memory of ``pid`` and its descendants, in MiB."""
    return sum(rss_mib(each) for each in tree(pid))


def machine_times() -> tuple[int, int]:
    """The machine's CPU time so far (all states) and the part of it the hypervisor took (steal), in ticks."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values[:8]), values[7] if len(values) > 7 else 0


async def closed_loop(url: str, model: str, concurrency: int, duration: float, path: str = "") -> Round:
    """``concurrency`` clients, each sending its next request when its stream ends, for ``duration`` seconds.

    The client is aiohttp, as in vLLM's serving benchmark: under 100 streams httpx spent 10 ms of this process's
    CPU per request through the gateway (2.5 ms direct) and saturated its core, so rounds measured the client."""
    body = {"model": model, **BODY}
    ttfts: list[float] = []
    errors = 0
    reasons: Counter[str] = Counter()
    stop_at = time.monotonic() + duration
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def user() -> None:
            nonlocal errors
            while time.monotonic() < stop_at:
                start = time.perf_counter()
                first, done, line = None, False, ""
                try:
                    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                        if response.status != 200:
                            errors += 1
                            reasons[f"HTTP {response.status}: {(await response.read())[:120]!r}"] += 1
                            continue
                        async for raw in response.content:  # one line at a time
                            line = raw.decode().rstrip("\r\n")
                            if first is None and line.startswith("data: {"):
                                first = time.perf_counter() - start
                            if line == "data: [DONE]":
                                done = True
                    if not done or first is None or '"error"' in line:
                        errors += 1
                        reasons[f"stream: {line[:160]}"] += 1
                        continue
                    ttfts.append(first)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    errors += 1
                    reasons[type(exc).__name__] += 1

        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return Round(path, len(ttfts), errors, elapsed, ttfts, dict(reasons))


def measured_round(stack: InstantStack, path: str, concurrency: int, duration: float) -> Round:
    """One round on ``path`` ("direct", "gateway", "against" or "floor") with each process's CPU per request and the
    steal (``cpu_ms["gateway"]``: the gateway, or the bare proxy, that served the round)."""
    url, model = stack.url(path)
    before = {name: tree_cpu_seconds(pid) for name, pid in stack.pids.items()} | {"client": time.process_time()}
    total_before, steal_before = machine_times()
    result = asyncio.run(closed_loop(url, model, concurrency, duration, path))
    after = {name: tree_cpu_seconds(pid) for name, pid in stack.pids.items()} | {"client": time.process_time()}
    total_after, steal_after = machine_times()
    done = result.requests or 1
    result.cpu_ms = {name: (after[name] - before[name]) / done * 1e3 for name in after}
    # a gateway that did not serve the round idled: its CPU then is not per request of anything
    served = result.cpu_ms.pop(path, None)
    for name in ("gateway", "against", "floor"):
        result.cpu_ms.pop(name, None)
    if served is not None:
        result.cpu_ms["gateway"] = served
    result.steal = (steal_after - steal_before) / max(1, total_after - total_before)
    result.gateway_rss_mib = tree_rss_mib(stack.pids[path if path in ("against", "floor") else "gateway"])
    return result


def rounds(
    stack: InstantStack,
    count: int,
    concurrency: int,
    duration: float,
    pause: float,
    paths: tuple[str, ...] = ("direct", "gateway"),
    slice_s: float | None = None,
) -> list[Round]:
    """``count`` rounds of ``duration`` seconds on each path against the same processes, ``pause`` seconds between
    rounds. ``slice_s``: the paths take turns every ``slice_s`` seconds within a round, so both see the machine
    at the same speed (on a shared VM a fixed loop's 20-second means move 1.5x); otherwise one after the other.
    Every other round takes the paths in the reverse order, so that none is always the first after a pause."""
    done: list[Round] = []
    slices = max(1, round(duration / slice_s)) if slice_s else 1
    for index in range(count):
        if index and pause:
            time.sleep(pause)
        parts: dict[str, list[Round]] = {path: [] for path in paths}
        for _ in range(slices):
            for path in paths if index % 2 == 0 else paths[::-1]:
                parts[path].append(measured_round(stack, path, concurrency, duration / slices))
        done += [merged(parts[path]) for path in paths]
    return done


def merged(parts: list[Round]) -> Round:
    """The slices of one path's round as one round: requests and seconds summed, CPU per request and steal
    weighted by what each slice did."""
    requests = sum(r.requests for r in parts)
    seconds = sum(r.seconds for r in parts)
    cpu = {name: sum(r.cpu_ms[name] * r.requests for r in parts) / max(1, requests) for name in parts[0].cpu_ms}
    reasons: Counter[str] = Counter()
    for r in parts:
        reasons.update(r.error_reasons)
    return Round(
        parts[0].path,
        requests,
        sum(r.errors for r in parts),
        seconds,
        [t for r in parts for t in r.ttfts],
        dict(reasons),
        cpu,
        sum(r.steal * r.seconds for r in parts) / seconds,
        parts[-1].gateway_rss_mib,
    )


def spread(values: list[float]) -> float:
    """max/min: how far apart the rounds are."""
    return max(values) / min(values)

"""Load test: N concurrent streaming clients on loopback for a fixed time, gateway vs the same backend direct.

    .venv/bin/python benchmarks/loadtest.py [--concurrency 200] [--duration 20]     (or: make loadtest)
    .venv/bin/python benchmarks/loadtest.py --concurrency 100 --rounds 5 --pause 60   (rounds that must agree)

The backend answers at once (benchmarks/fast_backend.py), so the numbers are the gateway's own cost.
Prompts are short (they bypass compression: the gateway tokenizes, renders the chat template and
proxies). Reports requests/s, TTFT p50/p99 (and the gateway's addition), errors, the CPU each process spent
per request, and the gateway's resident memory before, during and after the load. Everything runs on this
machine: the client, the gateway and the backend share its cores (``--pin`` gives the gateway one of its own),
which counts against every number here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

from common.process import free_port, wait_healthy
from specprefill.lab.load import percentile

ROOT = Path(__file__).resolve().parents[1]


def _cpu_s(pid: int) -> float:
    """CPU seconds the process has used, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_now(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each process, and by this one (the client)."""
    return {**{name: _cpu_s(pid) for name, pid in pids.items()}, "client": time.process_time()}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def load(url: str, model: str, concurrency: int, duration: float) -> dict:
    """``concurrency`` clients, each sending its next request when its stream ends, for ``duration`` seconds.

    The client is aiohttp, as in vLLM's serving benchmark: under 100 streams httpx spent 10 ms of this process's
    CPU per request through the gateway (2.5 ms direct) and saturated its core, so the rounds measured the
    client, not the gateway."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello there, how are you?"}],
            "max_tokens": 8, "stream": True}
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
    return {"requests": len(ttfts), "errors": errors, "rps": len(ttfts) / elapsed,
            "p50_ms": percentile(ttfts, 0.5) * 1e3, "p99_ms": percentile(ttfts, 0.99) * 1e3,
            "mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else float("nan"), "error_reasons": dict(reasons)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=1, help="loaded rounds per path against the same servers, "
                        "alternating direct and gateway; the spread of their requests/s is printed")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between rounds")
    parser.add_argument("--pin", action="store_true", help="the gateway on one core, the client and the backend on "
                        "another (the system under test then shares no core with the load)")
    args = parser.parse_args()
    from specprefill.lab.demo_models import ensure_demo_models

    root = ensure_demo_models()
    backend_port, gateway_port = free_port(), free_port()
    backend_url, gateway_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{gateway_port}"
    processes = [subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fast_backend.py"), str(backend_port)])]
    try:
        wait_healthy(backend_url)
        gateway = subprocess.Popen([sys.executable, "-m", "specprefill", "serve", "--port", str(gateway_port),
                                    "--backend-url", backend_url, "--backend-model", "fast",
                                    "--target-model", str(root / "target"), "--draft-model", str(root / "draft"),
                                    "--served-model-name", "demo", "--log-level", "warning"])
        processes.append(gateway)
        wait_healthy(gateway_url)
        if args.pin:
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(gateway.pid, cores[:1])
            for pid in (0, processes[0].pid):
                os.sched_setaffinity(pid, cores[1:] or cores)
        asyncio.run(load(gateway_url, "demo", 4, 2.0))  # warm-up
        rss_before = _rss_mib(gateway.pid)
        results = {}
        for name, url, model in (("sequential direct", backend_url, "fast"), ("sequential gateway", gateway_url, "demo")):
            results[name] = asyncio.run(load(url, model, 1, min(args.duration, 10.0)))
        rss_peak = rss_before
        rounds: dict[str, list[float]] = {"direct": [], "gateway": []}
        for index in range(args.rounds):
            if index and args.pause:
                time.sleep(args.pause)
            for name, url, model in (("direct", backend_url, "fast"), ("gateway", gateway_url, "demo")):
                label = name if args.rounds == 1 else f"{name} {index + 1}"
                pids = {"gateway": gateway.pid, "backend": processes[0].pid}
                before = _cpu_now(pids)
                results[label] = asyncio.run(load(url, model, args.concurrency, args.duration))
                after, done = _cpu_now(pids), results[label]["requests"] or 1
                # CPU per request of each process: a round that served fewer requests at the same CPU per request
                # was starved of the cores (scheduling), not slower (the gateway's own state)
                results[label]["cpu_ms"] = {part: (after[part] - before[part]) / done * 1e3 for part in after}
                rounds[name].append(results[label]["rps"])
                rss_peak = max(rss_peak, _rss_mib(gateway.pid))
        time.sleep(3)
        rss_after = _rss_mib(gateway.pid)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
    print(f"\n{'':>19} {'clients':>7} {'requests':>8} {'errors':>6} {'req/s':>7} {'TTFT p50':>9} {'p99':>8}"
          f"  CPU ms per request: gateway / backend / client")
    for name, r in results.items():
        clients = 1 if name.startswith("sequential") else args.concurrency
        cpu = " / ".join(f"{r['cpu_ms'][part]:.2f}" for part in ("gateway", "backend", "client")) if "cpu_ms" in r else ""
        print(f"{name:>19} {clients:>7} {r['requests']:>8} {r['errors']:>6} {r['rps']:>7.1f} "
              f"{r['p50_ms']:>7.2f}ms {r['p99_ms']:>6.1f}ms  {cpu}")
    for name, r in results.items():
        if r["error_reasons"]:
            print(f"{name} errors: {r['error_reasons']}")
    seq = results["sequential gateway"]["p50_ms"] - results["sequential direct"]["p50_ms"]
    last = "" if args.rounds == 1 else f" {args.rounds}"
    loaded = results["gateway" + last]["p50_ms"] - results["direct" + last]["p50_ms"]
    print(f"\ngateway p50 TTFT overhead: {seq:.2f} ms with one client, {loaded:.1f} ms with {args.concurrency}")
    if args.rounds > 1:
        for name, rps in rounds.items():
            print(f"{name} rounds: {', '.join(f'{r:.0f}' for r in rps)} req/s; max/min {max(rps) / min(rps):.2f}")
    print(f"gateway resident memory: {rss_before:.0f} MiB before, {rss_peak:.0f} MiB at peak, "
          f"{rss_after:.0f} MiB 3 s after the load")


if __name__ == "__main__":
    main()

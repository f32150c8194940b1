"""The load mode: Poisson arrivals at fixed rates; TTFT p50/p99 and the highest rate whose p99 meets the
objective, gateway vs direct."""

from __future__ import annotations

import asyncio
import math
import random
import time

import httpx
from tqdm import tqdm

from specprefill_lab.bench import stream_ttft, wait_idle


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[index]


def max_rate_meeting(results: list[dict], slo_s: float) -> float | None:
    """The highest offered rate whose p99 TTFT met the objective with no errors."""
    passing = [r["rate"] for r in results if r["p99_s"] <= slo_s and r["errors"] == 0]
    return max(passing) if passing else None


async def run_load(
    url: str,
    bodies: list[dict],
    headers: dict,
    rates: list[float],
    duration: float,
    seed: int = 0,
    idle_urls: list[str] = (),
) -> list[dict]:
    """Poisson arrivals at each rate for ``duration`` seconds; request i sends ``bodies[i % len(bodies)]``. Each
    rate starts once everything in ``idle_urls`` is idle (no earlier rate's backlog or background work)."""
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:
        for rate in tqdm(rates, desc=f"load {url}", unit="rate"):
            await wait_idle(client, idle_urls)
            arrivals = poisson_arrivals(rate, duration, random.Random(seed))
            start = time.perf_counter()

            async def one(index: int, at: float) -> float | None:
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
                try:
                    return (await stream_ttft(client, url, bodies[index % len(bodies)], headers))[0]
                except Exception:
                    return None

            ttfts = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
            ok = [t for t in ttfts if t is not None]
            results.append(
                {
                    "rate": rate,
                    "requests": len(ttfts),
                    "errors": len(ttfts) - len(ok),
                    "p50_s": percentile(ok, 0.5),
                    "p99_s": percentile(ok, 0.99),
                }
            )
    return results

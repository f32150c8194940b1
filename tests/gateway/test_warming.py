"""Warming's manners: pieces that extend what the engine holds, only in idle gaps likely to outlast them, resumed
where traffic interrupted them, recorded as they land."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import APIError
from gateway.costs import TARGET_TERMS, CostModel, target_features
from gateway.engine_cache import MemoryEngineCache
from gateway.engine_load import EngineLoad
from gateway.metrics import GatewayMetrics
from gateway.plan import Plan
from gateway.warming import Warmer
from tests.helpers import FCFSEngine, eventually


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _requests(load: EngineLoad, clock: Clock, gap: float, n: int) -> None:
    for _ in range(n):
        clock.now += gap
        load.enter()
        clock.now += 0.3
        load.leave()


class Setup:
    """A warmer in front of an ``FCFSEngine``, with the gateway's model of the engine's cache fed by what lands."""

    def __init__(self, *, piece_s: float = 0.05, gap: float = 10.0, send=None) -> None:
        self.engine = FCFSEngine()
        self.clock = Clock()
        self.load = EngineLoad(clock=self.clock)
        _requests(self.load, self.clock, gap, 8)
        self.model = MemoryEngineCache(16, 1 << 20)
        self.metrics = GatewayMetrics()
        self.landed: list[tuple[int, bool]] = []
        cost = CostModel(TARGET_TERMS, target_features, (0.01, 1e-4, 0.0, 0.0), fixed=True)  # 400 tokens in 50 ms
        self.warmer = Warmer(
            send or self.engine.complete,
            self._landed,
            self.load,
            self.model,
            cost,
            self.metrics,
            piece_s=piece_s,
            recheck_s=0.01,
        )

    async def _landed(self, plan: Plan, usage: dict | None, seconds: float, *, contended: bool) -> None:
        assert plan.kind == "warm" and plan.kept_indices is None
        await self.model.record(plan.token_ids, None)
        self.landed.append((len(plan.token_ids), contended))

    def count(self, outcome: str) -> float:
        return self.metrics.warming.labels(outcome)._value.get()

    async def done(self) -> bool:
        return await eventually(
            lambda: self.metrics.warming_pending._value.get() == 0 and self.count("done") > 0, within=5
        )


def _plan(n: int, seed: int = 0) -> Plan:
    return Plan([10 + (seed * 7919 + i * 31) % 4000 for i in range(n)], status="compressed", kept_indices=[0])


async def test_a_warm_goes_in_pieces_that_extend_what_the_engine_holds():
    setup = Setup()
    setup.warmer.offer(_plan(1000))
    assert setup.metrics.warming_pending._value.get() == 1
    assert await setup.done()
    # 400 tokens fit 50 ms; the last piece takes the rest rather than leave less than a block
    assert [(r["tokens"], r["cached"], r["priority"]) for r in setup.engine.requests] == [
        (400, 0, 10),
        (800, 400, 10),
        (1000, 800, 10),
    ]
    assert setup.landed == [(400, False), (800, False), (1000, False)]
    assert await setup.model.cached_tokens(_plan(1000).token_ids, None) == 992
    await setup.warmer.close()


async def test_no_piece_starts_while_a_request_is_here_or_due():
    setup = Setup(gap=0.02)  # back-to-back traffic: the next request always comes within 20 ms
    setup.warmer.offer(_plan(1000))
    await asyncio.sleep(0.1)
    assert setup.engine.requests == []
    setup.clock.now += 5.0  # idle for longer than any gap seen: no request is due
    assert await eventually(lambda: len(setup.engine.requests) >= 1, within=2)
    setup.load.enter()  # a request arrives: no new piece while it is here
    count = len(setup.engine.requests)
    await asyncio.sleep(0.2)
    assert len(setup.engine.requests) <= count + 1  # the piece already at the engine, at most
    setup.load.leave()
    setup.clock.now += 20.0  # twice the longest gap (the 5 s before that request) and more: a pause again
    assert await setup.done()
    await setup.warmer.close()


async def test_a_warm_interrupted_by_traffic_resumes_where_it_stopped():
    """The cause of a shared system prompt compressed on every request: each request cancelled the warm, whole,
    before it had landed, so the gateway never learnt that the engine held it. Pieces land one by one."""
    release = asyncio.Event()
    attempts: list[int] = []
    setup: Setup

    async def send(token_ids: list[int], priority: int | None) -> dict:
        attempts.append(len(token_ids))
        await release.wait()
        release.clear()
        return await setup.engine.complete(token_ids, priority)

    setup = Setup(send=send)
    setup.warmer.offer(_plan(2000))
    release.set()
    assert await eventually(lambda: len(setup.landed) == 1 and len(attempts) == 2, within=2)
    setup.load.enter()  # a request arrives while the second piece is at the engine
    release.set()
    await asyncio.sleep(0.1)
    assert len(setup.landed) == 2 and len(attempts) == 2  # that piece landed; no new one started while it was here
    setup.load.leave()
    setup.clock.now += 5.0
    for _ in range(3):
        assert await eventually(lambda: release.is_set() is False and len(attempts) > len(setup.landed), within=2)
        release.set()
    assert await setup.done()
    assert [n for n, _ in setup.landed] == [400, 800, 1200, 1600, 2000]
    assert [r["cached"] for r in setup.engine.requests] == [0, 400, 800, 1200, 1600]  # nothing computed twice
    await setup.warmer.close()


async def test_a_growing_context_replaces_its_earlier_warm_and_a_refused_priority_is_dropped():
    sent: list[tuple[int, int | None]] = []

    async def send(token_ids: list[int], priority: int | None) -> dict:
        sent.append((len(token_ids), priority))
        if priority is not None:
            raise APIError("priority is not supported by this server", status_code=400)
        return {"usage": None}

    setup = Setup(send=send, piece_s=10.0)
    turn = _plan(600)
    setup.warmer.offer(turn)
    setup.warmer.offer(Plan(turn.token_ids + list(range(50, 450)), status="compressed"))  # the next turn
    assert setup.count("superseded") == 1
    assert await setup.done()
    assert sent == [(1000, 10), (1000, None)]  # one job, one piece; then no priority ever again
    setup.warmer.offer(_plan(700, seed=3))
    assert await eventually(lambda: setup.count("done") == 2, within=2)
    assert sent[-1] == (700, None)
    await setup.warmer.close()


@pytest.mark.parametrize("length", [16 * 4096])
async def test_a_context_larger_than_the_engine_keeps_is_not_warmed(length):
    setup = Setup()
    setup.model = MemoryEngineCache(16, 4096)
    setup.warmer.cache = setup.model
    setup.warmer.offer(_plan(length))
    assert setup.count("offered") == 0 and setup.engine.requests == []
    await setup.warmer.close()

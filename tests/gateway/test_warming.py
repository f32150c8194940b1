"""Warming's manners: pieces that extend what the engine holds, only in idle gaps likely to outlast them, resumed
where traffic interrupted them, recorded as they land."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import APIError
from gateway.engines.cache import MemoryEngineCache
from gateway.engines.load import EngineLoad
from gateway.metrics import GatewayMetrics
from gateway.planning.costs import TARGET_TERMS, CostModel, target_features
from gateway.planning.plan import Plan
from gateway.planning.warming import Warmer
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

    def __init__(self, *, piece_s: float = 0.05, gap: float = 10.0, send=None, quiet_blocks: int = 4) -> None:
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
            quiet_blocks=quiet_blocks,
        )

    async def _landed(self, plan: Plan, usage: dict | None, seconds: float, *, contended: bool) -> None:
        assert plan.kind == "warm" and plan.position_ids is None
        await self.model.record(plan.token_ids, None)
        self.landed.append((len(plan.token_ids), contended))

    def count(self, outcome: str) -> float:
        return self.metrics.warming.labels(outcome)._value.get()

    async def done(self) -> bool:
        return await eventually(
            lambda: self.metrics.warming_pending._value.get() == 0 and self.count("done") > 0, within=5
        )


def _plan(n: int, seed: int = 0) -> Plan:
    return Plan([10 + (seed * 7919 + i * 31) % 4000 for i in range(n)], status="compressed", position_ids=[0])


async def test_a_warm_goes_in_pieces_that_extend_what_the_engine_holds():
    setup = Setup()
    setup.warmer.offer(_plan(1000).token_ids)
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


async def test_where_a_block_outlasts_a_piece_quiet_windows_take_a_few_blocks_at_once():
    # measured on vLLM's CPU build: one 128-token block on 24,000 cached tokens took 2.8 s, about 0.7 s of it the
    # request's own cost; pieces of one block each spent a quarter of a warm on that
    for gap, idle, piece in ((10.0, 0.01, 352), (0.05, 0.01, 16), (0.05, 30.0, 352)):
        # one block takes 11.6 ms here, more than the 5 ms piece; four blocks' time (46 ms) holds 22 blocks at
        # once. 10 s gaps: a think time under way; 50 ms gaps: one block fits (twice its time), four do not;
        # 30 s idle after them: a pause
        setup = Setup(gap=gap, piece_s=0.005)
        setup.clock.now += idle
        setup.warmer.offer(_plan(1000).token_ids)
        assert await eventually(lambda: len(setup.engine.requests) >= 1, within=2)  # noqa: B023
        assert setup.engine.requests[0]["tokens"] == piece, (gap, idle)
        await setup.warmer.close()


def test_the_time_before_the_first_request_is_no_gap():
    clock = Clock()
    load = EngineLoad(clock=clock)
    clock.now += 600.0  # the gateway started ten minutes before its first request
    _requests(load, clock, 0.05, 5)  # then an agent's requests back to back
    clock.now += 2.0
    assert load.paused  # the traffic has paused: 2 s, and twice the longest gap between requests


async def test_no_piece_starts_while_a_request_is_here_or_due():
    setup = Setup(gap=0.02)  # back-to-back traffic: the next request always comes within 20 ms
    setup.warmer.offer(_plan(1000).token_ids)
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
    setup.warmer.offer(_plan(2000).token_ids)
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
    setup.warmer.offer(turn.token_ids)
    setup.warmer.offer([*turn.token_ids, *range(50, 450)])  # the next turn, as a rendered list
    assert setup.count("superseded") == 1
    assert await setup.done()
    assert sent == [(1000, 10), (1000, None)]  # one job, one piece; then no priority ever again
    setup.warmer.offer(_plan(700, seed=3).token_ids)
    assert await eventually(lambda: setup.count("done") == 2, within=2)
    assert sent[-1] == (700, None)
    await setup.warmer.close()


@pytest.mark.parametrize("length", [16 * 4096])
async def test_a_context_larger_than_the_engine_keeps_is_not_warmed(length):
    setup = Setup()
    setup.model = MemoryEngineCache(16, 4096)
    setup.warmer.cache = setup.model
    setup.warmer.offer(_plan(length).token_ids)
    assert setup.count("offered") == 0 and setup.engine.requests == []
    await setup.warmer.close()

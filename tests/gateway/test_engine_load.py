"""What the engine is doing now: the wait ahead of a request, contended timings, idle gaps, others' requests."""

from __future__ import annotations

import asyncio

import pytest

from gateway.engines.load import EngineLoad


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _load(**kwargs) -> tuple[EngineLoad, Clock]:
    clock = Clock()
    return EngineLoad(clock=clock, **kwargs), clock


def test_a_request_waits_for_the_prefill_left_ahead_of_it():
    """The requests ahead are worked off one after the other: the second starts when the first is done."""
    load, clock = _load()
    assert load.wait_s() == 0
    first = load.begin(2.0)
    clock.now += 0.5
    second = load.begin(1.0, background=True)
    assert load.wait_s() == pytest.approx(1.5 + 1.0)
    clock.now += 1.0
    assert load.wait_s() == pytest.approx(0.5 + 1.0)  # the second has not begun: all of it is left
    load.answered(first)  # decoding now, 0.5 s early: the second begins
    assert load.wait_s() == pytest.approx(1.0)
    clock.now += 1.5
    assert load.wait_s() == 0  # the second ran past its prediction: nothing left of it
    load.end(first), load.end(second)
    assert load.wait_s() == 0 and load.idle


def test_a_backlog_is_worked_off_in_turn_not_all_at_once():
    """Ten 1 s prefills sent together: 10 s of work ahead. Counted each from its own send, as if the engine ran
    them side by side at full speed each, 5 s later the wait read 0 where 5 s of it was left."""
    load, clock = _load()
    backlog = [load.begin(1.0) for _ in range(10)]
    assert load.wait_s() == pytest.approx(10.0)
    clock.now += 5.0
    assert load.wait_s() == pytest.approx(5.0)
    for ticket in backlog[:5]:  # answered as predicted: nothing changes
        load.answered(ticket)
    assert load.wait_s() == pytest.approx(5.0)
    for ticket in backlog:
        load.end(ticket)


def test_background_work_an_engine_stops_for_a_request_is_not_ahead_of_it():
    """The reference engine stops a background chunk between two layers for a new request: a warming piece
    under way there is no wait; a foreground request still is."""
    load, _ = _load(background_yields=True)
    piece = load.begin(0.1, background=True)
    assert load.wait_s() == 0
    request = load.begin(2.0)
    assert load.wait_s() == pytest.approx(2.0)
    load.end(piece), load.end(request)


def test_others_requests_at_the_engine_count_as_typical_requests():
    load, clock = _load()
    for seconds in (0.2, 0.3, 0.4):  # clean requests, one at a time
        ticket = load.begin(0.3)
        clock.now += seconds
        load.answered(ticket), load.end(ticket)
    load.external = 2
    assert load.wait_s() == pytest.approx(0.6) and not load.idle


def test_a_shared_engine_is_predicted_at_the_speed_it_has_shown_while_shared():
    """While requests share the engine (and, on a CPU, the gateway's draft shares its cores), they take longer
    than their idle-speed predictions say; the predictions of requests sent into a busy engine take the
    measured slowdown; those sent into an idle one take their own (next test), 1 until four are seen."""
    load, clock = _load()
    assert load.estimate(0.2) == (0.0, 0.2, 0.2)
    for _ in range(6):
        first = load.begin(0.2)
        _, _, expected = load.estimate(0.1)
        second = load.begin(0.1, expected_s=expected)  # expected: 0.2 ahead, then 0.1 of its own
        clock.now += 0.9  # three times as long
        load.answered(first), load.answered(second), load.end(first), load.end(second)
    assert load.slowdown(busy=True) == pytest.approx(3.0)
    assert load.estimate(0.2) == (0.0, 0.2, 0.2)  # an idle engine: its own speed
    busy = load.begin(0.5)
    wait, predicted, expected = load.estimate(0.2)
    assert (wait, predicted, expected) == pytest.approx((1.5, 2.1, 0.7))
    assert load.wait_s() == pytest.approx(1.5)
    load.end(busy)


def test_under_heavy_traffic_a_request_sent_into_an_idle_engine_is_predicted_shared_too():
    """Requests arriving during a prefill share the engine's steps with it (vLLM's chunked prefill), so under
    heavy traffic a request that found the engine idle is slowed as well: its prediction takes the slowdown that
    requests sent into an idle engine have shown, learnt apart from those sent into a busy one."""
    load, clock = _load()
    for _ in range(4):
        _, _, expected = load.estimate(0.1)
        alone = load.begin(0.1, expected_s=expected)  # sent into an idle engine
        arrived = load.begin(0.3)  # a request that arrives during its prefill
        clock.now += 0.4
        load.answered(alone), load.answered(arrived), load.end(alone), load.end(arrived)
    assert load.slowdown(busy=False) == pytest.approx(4.0) and load.slowdown(busy=True) == 1.0
    assert load.estimate(0.1) == pytest.approx((0.0, 0.4, 0.1))
    for _ in range(4):  # the traffic thins out: requests sent into an idle engine run alone again
        _, _, expected = load.estimate(0.1)
        alone = load.begin(0.1, expected_s=expected)
        clock.now += 0.1
        load.answered(alone), load.end(alone)
    assert load.slowdown(busy=False) == pytest.approx(2.5)  # the median of four at 4x and four at 1x
    for _ in range(8):
        alone = load.begin(0.1, expected_s=0.1)
        clock.now += 0.1
        load.answered(alone), load.end(alone)
    assert load.estimate(0.1) == pytest.approx((0.0, 0.1, 0.1))


def test_timings_that_shared_the_engine_are_contended():
    load, clock = _load()
    alone = load.begin(0.1)
    clock.now += 0.1
    load.answered(alone), load.end(alone)
    assert not alone.contended
    first = load.begin(0.5)
    second = load.begin(0.5)  # arrives while the first is still in its prefill: both slowed
    assert first.contended and second.contended
    load.answered(first)
    third = load.begin(0.5)  # the first was answered already: its timing stands
    load.answered(second), load.answered(third)
    assert third.contended
    for ticket in (first, second, third):
        load.end(ticket)
    load.external = 1  # someone else's request at the engine
    assert load.begin(0.1).contended


def test_a_request_behind_background_work_counts_the_time_it_spent_beside_it():
    load, clock = _load()
    piece = load.begin(0.3, background=True)
    clock.now += 0.1
    request = load.begin(0.2)
    clock.now += 0.15
    load.answered(piece), load.end(piece)
    clock.now += 0.2
    assert request.behind == [piece] and load.answered(request) == pytest.approx(0.15)
    load.end(request)
    clean = load.begin(0.2)
    assert load.answered(clean) == 0 and not clean.behind


def test_background_work_starts_only_in_an_idle_gap_likely_to_outlast_it():
    load, clock = _load(min_history=4)

    def requests(gap: float, n: int) -> None:
        for _ in range(n):
            clock.now += gap
            load.enter()
            clock.now += 0.3
            load.leave()

    assert not load.quiet_for(0.1, 0.9)  # no history: no one knows when the next request comes
    fresh, fresh_clock = _load()
    fresh_clock.now += 2.0
    assert fresh.quiet_for(0.1, 0.9)  # but two seconds of nothing is a pause
    requests(0.02, 8)  # back to back
    assert not load.quiet_for(0.1, 0.9)
    clock.now += 0.5  # idle longer than any gap seen, yet not long: the next gap may be a little longer
    assert not load.quiet_for(0.1, 0.9)
    clock.now += 1.5  # a pause: the traffic stopped
    assert load.quiet_for(0.1, 0.9)
    load.enter()
    assert not load.quiet_for(0.1, 0.9)  # a request is here
    load.leave()
    requests(1.0, 64)  # a user's think time
    assert load.quiet_for(0.5, 0.9)
    clock.now += 0.6
    assert not load.quiet_for(0.5, 0.9)  # it would end after the next request is due
    assert load.quiet_for(0.3, 0.9)
    clock.now += 0.5
    assert not load.quiet_for(0.01, 0.9)  # past every gap, not yet twice the longest
    clock.now += 1.0
    assert load.quiet_for(0.01, 0.9)
    ticket = load.begin(0.1, background=True)
    assert not load.quiet_for(0.01, 0.9)  # one piece at a time
    load.end(ticket)
    load.external = 1
    assert not load.quiet_for(0.01, 0.9)  # someone else's request


async def test_the_engine_count_beyond_this_gateways_is_someone_elses():
    load = EngineLoad()
    counts = [3, 1, None]
    read = asyncio.Event()

    async def engine_count() -> int | None:
        read.set()
        if not counts:
            raise RuntimeError("metrics unreadable")
        return counts.pop(0)

    ours = load.begin(0.1)
    load.watch(engine_count, 0.01)
    for external in (2, 0, 0, 0):
        read.clear()
        await asyncio.wait_for(read.wait(), 1)
        await asyncio.sleep(0)
        assert load.external == external
    load.end(ours)
    await load.close()


async def test_a_request_just_answered_that_the_engine_still_counts_is_not_someone_elses():
    """The engine counts a request done a little after its answer (the reference engine stores its blocks first):
    a read in that window is not another client's request, which would price every plan a typical request
    slower until the next read."""
    clock = Clock()
    load = EngineLoad(clock=clock)
    read = asyncio.Event()

    async def engine_count() -> int:
        read.set()
        return 1

    ours = load.begin(0.1)
    load.end(ours)  # answered, and still counted by the engine
    load.watch(engine_count, 0.01)
    await asyncio.wait_for(read.wait(), 1)
    await asyncio.sleep(0)
    assert load.external == 0
    clock.now += 1.0  # long after: that one is someone else's
    read.clear()
    await asyncio.wait_for(read.wait(), 1)
    await asyncio.sleep(0.02)
    assert load.external == 1
    await load.close()

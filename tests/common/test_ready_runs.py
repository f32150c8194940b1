"""``in_runs``: an async iterator's items in runs of those ready together, each run written before anything is
waited for; cancellation and a failed write unwind the iterator as a task's cancellation would."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.ready_runs import in_runs


async def _collected(iterator) -> list[tuple[list, bool]]:
    runs: list[tuple[list, bool]] = []

    async def write(run, last):
        runs.append((list(run), last))

    await in_runs(iterator, write)
    return runs


async def test_items_ready_together_are_one_run_and_a_wait_ends_a_run():
    async def items():
        yield 1
        yield 2
        yield 3
        await asyncio.sleep(0)
        yield 4
        await asyncio.sleep(0.001)
        yield 5
        yield 6

    # the first alone, at once (the others ready behind it would hold it back); then runs
    assert await _collected(items()) == [([1], False), ([2, 3], False), ([4], False), ([5, 6], True)]


async def test_a_run_is_written_before_the_next_item_is_waited_for():
    """The iterator's next item waits for the previous run's write: were the run held back, this would hang."""
    written = asyncio.Event()

    async def items():
        yield "a"
        await written.wait()
        yield "b"

    async def write(run, last):
        if run == ["a"]:
            written.set()

    await asyncio.wait_for(in_runs(items(), write), 2)


async def test_every_item_once_in_order_whatever_the_waits():
    rng = random.Random(7)
    plan = [rng.choice([None, 0, 0.0005]) for _ in range(300)]

    async def items():
        for i, wait in enumerate(plan):
            if wait is not None:
                await asyncio.sleep(wait)
            yield i

    runs = await _collected(items())
    assert [i for run, _ in runs for i in run] == list(range(len(plan)))
    assert [last for _, last in runs] == [False] * (len(runs) - 1) + [True]
    assert all(run for run, _ in runs[:-1])
    waits = sum(1 for w in plan[1:] if w is not None)
    assert len(runs) <= waits + 2  # a run ends only where an item waited


async def test_a_value_sent_or_an_error_raised_while_waiting_reaches_the_iterator():
    """The hand-stepped ``__anext__`` is awaited on as if from its start: a future's result, and its error."""
    loop = asyncio.get_running_loop()
    ok, bad = loop.create_future(), loop.create_future()
    loop.call_soon(ok.set_result, "value")
    seen = []
    runs: list[tuple[list, bool]] = []

    async def items():
        yield await ok
        try:
            await bad
        except ValueError as exc:
            seen.append(str(exc))
        yield "after"

    async def write(run, last):
        runs.append((list(run), last))
        if run == ["value"]:  # written once the next step waits on ``bad``: its error comes while it waits
            loop.call_soon(bad.set_exception, ValueError("boom"))

    # (with two timers 1 ms apart, a busy machine's loop once ran both before the iterator asked again)
    await asyncio.wait_for(in_runs(items(), write), 5)
    assert runs == [(["value"], False), (["after"], True)]
    assert seen == ["boom"]


async def test_cancelled_while_waiting_the_iterator_is_closed():
    closed = asyncio.Event()

    async def items():
        try:
            yield 1
            await asyncio.sleep(60)
            yield 2
        finally:
            await asyncio.sleep(0)  # a cleanup that awaits
            closed.set()

    written = []

    async def write(run, last):
        written.append(run)

    task = asyncio.ensure_future(in_runs(items(), write))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed.is_set() and written == [[1]]


async def test_a_first_write_that_fails_closes_the_iterator():
    closed = []

    async def items():
        try:
            yield 1
            yield 2
        finally:
            await asyncio.sleep(0)
            closed.append(True)

    async def write(run, last):
        raise ConnectionResetError("the client left")

    with pytest.raises(ConnectionResetError):
        await in_runs(items(), write)
    assert closed == [True]


async def test_a_write_that_fails_unwinds_the_waiting_step():
    """The run is written while the next item's step waits, half-stepped: a failed write throws its error in
    there, the iterator's ``finally`` (awaiting) runs, and the error reaches the caller."""
    closed = []

    async def items():
        try:
            yield 1
            yield 2
            await asyncio.sleep(60)
            yield 3
        finally:
            await asyncio.sleep(0)
            closed.append(True)

    async def write(run, last):
        if run == [2]:
            raise ConnectionResetError("the client left")

    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(in_runs(items(), write), 2)
    assert closed == [True]


async def test_cancelled_during_a_write_the_waiting_step_is_unwound():
    closed = []
    in_write = asyncio.Event()

    async def items():
        try:
            yield 1
            yield 2
            await asyncio.sleep(60)
        finally:
            closed.append(True)

    async def write(run, last):
        if run == [2]:
            in_write.set()
            await asyncio.sleep(60)  # a write held up by flow control

    task = asyncio.ensure_future(in_runs(items(), write))
    await in_write.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed == [True]

"""An async iterator's items in runs: those that were ready one after another, without waiting, go together.

A streamed answer relayed from a backend gets its events in reads: when the gateway's loop is busy (many
streams) or the engine is fast, one read holds several events, and each was one socket write to the client.
``in_runs`` hands them to their writer as one run, written before anything is waited for: a run is never held
back for an item still to come, and the writes are fewer. (An item behind others in its run waits for them to
be made, a few microseconds each: the first item goes alone.)

Whether the next item is ready is known only by asking for it: its ``__anext__`` is stepped by hand, and where it
must wait, the step is awaited from there on (``_resumed``, PEP 380's ``yield from`` begun one step late) after
the run so far is written. A write that fails there unwinds the waiting step with the write's exception, as a
cancelled task would (``_unwound``): the iterator's ``finally`` blocks run, and nothing is left half-stepped.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")
Step = Coroutine[Any, Any, Any]


async def in_runs(iterator: AsyncIterator[T], write: Callable[[list[T], bool], Awaitable[None]]) -> None:
    """Every item of ``iterator`` passed to ``write(run, last)``, in runs of the items ready one after another;
    ``last`` on the final call (made at the iterator's end, with what is left, perhaps nothing). The first item,
    ready at once, goes alone: the others ready behind it would hold back the stream's first event by the time
    they take to make (an engine's first event is what a client's time to the first token waits on)."""
    run: list[T] = []
    first = True
    while True:
        step: Step = iterator.__anext__()  # type: ignore[assignment]
        try:
            yielded = step.send(None)
        except StopIteration as ready:  # the next item, without waiting
            run.append(ready.value)
            if first:  # the first goes alone, at once: what the client's time to the first event waits on
                first = False
                try:
                    await write(run, False)
                except BaseException:
                    await _closed(iterator)
                    raise
                run = []
            continue
        except StopAsyncIteration:
            break
        first = False
        if run:  # the next item must wait: what was ready goes out first
            try:
                await write(run, False)
            except BaseException as exc:
                await _unwound(step, exc)
                raise
            run = []
        try:
            run.append(await _resumed(step, yielded))
        except StopAsyncIteration:
            break
    await write(run, True)


@types.coroutine
def _resumed(step: Step, yielded: Any) -> Generator[Any, Any, Any]:
    """The rest of ``step``, a coroutine stepped once by hand that yielded ``yielded`` to the loop, awaited as if
    from its start: what the loop sends or throws goes on to it."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            step.close()
            raise
        except BaseException as exc:
            try:
                yielded = step.throw(exc)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                yielded = step.send(sent)
            except StopIteration as stop:
                return stop.value


async def _closed(iterator: AsyncIterator[Any]) -> None:
    """``iterator``, between items, closed (its ``finally`` blocks run), where it can be."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


async def _unwound(step: Step, exc: BaseException) -> None:
    """``step``, waiting, ended by ``exc`` thrown in where it waits; its cleanup awaited; whatever it ends with is
    dropped (the caller raises ``exc``)."""
    try:
        yielded = step.throw(exc)
    except BaseException:
        return
    try:
        await _resumed(step, yielded)
    except BaseException:
        return

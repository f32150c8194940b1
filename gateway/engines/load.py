"""What the engine is doing now, as far as the gateway can tell.

Three sources: this gateway's own requests at the backend (foreground, and its background warming pieces), the
engine's own count of running and waiting requests (polled from its ``/metrics``: the part that is someone
else's), and the idle gaps between this gateway's requests. Three uses:
  a plan is priced with the wait ahead of it, at the speed the engine has shown while shared (``estimate``);
  the cost models learn only from timings that nothing else shared the engine with (``Ticket.contended``);
  warming starts a piece only while the engine is idle and likely to stay idle until it ends (``quiet_for``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("specprefill.gateway")
PAUSE_S = 2.0  # idle this long, and twice the longest recent gap, the traffic has paused: no request is due
SETTLE_S = 0.25  # a request this gateway saw answered may still count at the engine for this long (it stores
# the request's blocks, then counts it done)


@dataclass(slots=True, eq=False)
class Ticket:
    """One request of this gateway at the backend, from its send until the engine is done with it."""

    background: bool
    predicted_s: float  # the engine's own time for it (no wait)
    started: float
    expected_s: float = 0.0  # its backend time as predicted at the send, at the engine's idle speed
    first_event: float | None = None  # its prefill is over
    ended: float | None = None
    contended: bool = False  # something else ran at the engine before its first event
    busy_at_send: bool = False  # something was at the engine when it was sent
    behind: list[Ticket] = field(default_factory=list)  # background work it found at the engine


@dataclass(frozen=True, slots=True)
class Snapshot:
    epoch: int  # tickets begun by then


class EngineLoad:
    def __init__(
        self,
        *,
        history: int = 64,
        min_history: int = 4,
        clock: Callable[[], float] = time.monotonic,
        background_yields: bool = False,
    ) -> None:
        self.clock = clock
        # the engine stops background work under way for a new request (the reference engine does, between two
        # layers): none of it is ahead of a foreground request
        self.background_yields = background_yields
        self.min_history = min_history
        self.external = 0  # requests the engine runs or queues beyond this gateway's (its /metrics)
        self._alive: list[Ticket] = []
        self._epoch = 0  # tickets begun so far
        self._active = 0  # foreground requests being planned or at the backend
        self._idle_since: float | None = clock()
        self._started = True  # no request yet: the time since the gateway started is no gap between requests
        self._gaps: collections.deque[float] = collections.deque(maxlen=history)
        self._typical = RecentMedian(32)  # clean foreground seconds
        # measured/expected of recent foreground requests, by whether they were sent into a busy engine
        self._slowdowns = {busy: RecentMedian(32) for busy in (True, False)}
        self._changed = asyncio.Event()
        self._watcher: asyncio.Task[Any] | None = None
        self._ended: collections.deque[float] = collections.deque(maxlen=64)  # when recent tickets ended

    # --- foreground activity: idle gaps ---

    def enter(self) -> None:
        """A foreground request arrived (it is planned, then sent)."""
        now = self.clock()
        if self._active == 0 and self._idle_since is not None:
            if not self._started:
                self._gaps.append(now - self._idle_since)
            self._idle_since, self._started = None, False
        self._active += 1
        self._notify()

    def leave(self) -> None:
        self._active -= 1
        assert self._active >= 0
        if self._active == 0:
            self._idle_since = self.clock()
        self._notify()

    @property
    def outstanding(self) -> int:
        """This gateway's foreground requests at the engine now."""
        return sum(not t.background for t in self._alive)

    @property
    def idle(self) -> bool:
        return self._active == 0 and not self._alive and self.external == 0

    @property
    def paused(self) -> bool:
        """The traffic has paused: idle for twice the longest recent gap, and ``PAUSE_S`` at least."""
        if not self.idle or self._idle_since is None:
            return False
        return self.clock() - self._idle_since >= max(PAUSE_S, 2 * max(self._gaps, default=0.0))

    def quiet_for(self, seconds: float, confidence: float) -> bool:
        """Whether background work of ``seconds`` may start now: no foreground request here, nothing at the
        engine, and either a pause (idle for twice the longest recent gap, and ``PAUSE_S`` at least: the
        traffic stopped) or, among the recent idle gaps as long as this one has lasted so far, at least
        ``confidence`` of them lasting ``seconds`` more. Idle for longer than every recent gap but not yet a
        pause, or with too few gaps seen to tell, nothing starts."""
        if not self.idle or self._idle_since is None:
            return False
        if self.paused:
            return True
        so_far = self.clock() - self._idle_since
        survived = [g for g in self._gaps if g > so_far]
        if len(self._gaps) < self.min_history or not survived:
            return False
        return sum(g >= so_far + seconds for g in survived) >= confidence * len(survived)

    async def changed(self, timeout: float) -> None:
        """Until the activity changes, or ``timeout`` seconds."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _notify(self) -> None:
        self._changed.set()

    # --- requests at the backend ---

    def begin(self, predicted_s: float, *, background: bool = False, expected_s: float = 0.0) -> Ticket:
        now = self.clock()
        busy = bool(self._alive) or self.external > 0
        ticket = Ticket(background, predicted_s, now, expected_s, contended=busy, busy_at_send=busy)
        for other in self._alive:
            if other.first_event is None:
                other.contended = True
            if other.background and not background:
                ticket.behind.append(other)
        self._alive.append(ticket)
        self._epoch += 1
        self._notify()
        return ticket

    def answered(self, ticket: Ticket) -> float:
        """The ticket's first event came; the seconds it spent at the engine alongside background work."""
        now = self.clock()
        ticket.first_event = now
        behind = sum(min(b.ended or now, now) - ticket.started for b in ticket.behind)
        if not ticket.background and not ticket.contended:
            self._typical.append(now - ticket.started)
        if not ticket.background and ticket.expected_s > 0:
            self._slowdowns[ticket.busy_at_send].append((now - ticket.started) / ticket.expected_s)
        return max(0.0, behind)

    def end(self, ticket: Ticket) -> None:
        if ticket.first_event is None:
            ticket.first_event = self.clock()
        ticket.ended = self.clock()
        if ticket in self._alive:
            self._alive.remove(ticket)
            self._ended.append(ticket.ended)
        self._notify()

    def typical_s(self) -> float | None:
        """The median time from the send of a recent request, alone at the engine, to its first event (None:
        none seen yet)."""
        return self._typical.median()

    def wait_s(self) -> float:
        """Predicted seconds before the engine starts on a new foreground request: the prefill left of every
        request ahead of it (an engine runs what it has first: vLLM schedules running requests before waiting
        ones, whatever their priority; background work only where it does not yield), and a typical request for
        each of someone else's; at the busy engine's speed. The engine's prefill throughput is shared, not
        multiplied: requests ahead are worked off one after the other (FCFS, or batched in the same steps, the
        total is the same), each from when the engine was done with those before it."""
        return self._idle_wait() * self.slowdown(busy=True)

    def estimate(self, target_s: float) -> tuple[float, float, float]:
        """For a request whose own engine time is ``target_s`` (on an idle engine), sent now: the wait ahead of it,
        its predicted backend time (the wait, then its own time, both at the busy engine's speed), and that
        time at the idle engine's speed (what the slowdown is learnt against)."""
        idle = self._idle_wait()
        factor = self.slowdown(busy=bool(self._alive) or self.external > 0)
        return idle * factor, (idle + target_s) * factor, idle + target_s

    def slowdown(self, busy: bool) -> float:
        """How much slower than its idle speed predicts the engine has answered recent requests sent into it
        busy (``busy``) or idle: the median of their measured over expected times, 1 until four are seen. A CPU
        engine shares its cores with the gateway's draft; a busy one batches requests whose costs do not
        simply add; and under heavy traffic a request sent into an idle engine shares it with the requests that
        arrive during its prefill (vLLM's chunked prefill runs them in the same steps), so it is slowed too."""
        recent = self._slowdowns[busy]
        if len(recent) < 4:
            return 1.0
        return min(20.0, max(1.0, float(recent.median() or 1.0)))

    def _idle_wait(self) -> float:
        # when the engine is done with this gateway's prefills, each begun after those sent before it are done
        # (a request answered is done at its first event); counting each from its own send, a backlog was taken
        # for parallel work: requests queued behind a 10 s backlog were priced at 1 s
        now, free = self.clock(), float("-inf")
        for ticket in self._alive:  # in the order they were sent
            if ticket.background and self.background_yields:
                continue
            if ticket.first_event is not None:
                free = max(free, ticket.first_event)
            else:
                free = max(free, ticket.started) + ticket.predicted_s
        typical = (self._typical.median() or 0.0) if self.external else 0.0
        return max(0.0, free - now) + self.external * typical

    def snapshot(self) -> Snapshot:
        return Snapshot(self._epoch)

    def undisturbed(self, since: Snapshot) -> bool:
        """Whether nothing ran at the engine since ``since`` (a draft timed then shared no hardware with it)."""
        return self._epoch == since.epoch and not self._alive and self.external == 0

    # --- the engine's own count ---

    def watch(self, read: Callable[[], Awaitable[int | None]], interval: float) -> None:
        """Reads the engine's running + waiting requests every ``interval`` seconds, in the background; what this
        gateway did not send, or saw answered just before (``SETTLE_S``), is someone else's. A failed read counts
        as nobody else's."""
        self._watcher = asyncio.ensure_future(self._watch(read, interval))

    async def _watch(self, read: Callable[[], Awaitable[int | None]], interval: float) -> None:
        while True:
            own_before, since = len(self._alive), self.clock() - SETTLE_S
            try:
                count = await read()
            except Exception as exc:  # the engine's metrics are a hint, never an error
                logger.debug("engine load unreadable: %s", type(exc).__name__)
                count = None
            own = max(own_before, len(self._alive)) + sum(t >= since for t in self._ended)
            external = max(0, count - own) if count is not None else 0
            if external != self.external:
                self.external = external
                self._notify()
            await asyncio.sleep(interval)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)


class RecentMedian:
    """The last ``size`` values and their median, found again only after a value is added (a price reads it for
    every request; ``statistics.median`` sorts a copy each time)."""

    def __init__(self, size: int) -> None:
        self._values: collections.deque[float] = collections.deque(maxlen=size)
        self._median: float | None = None

    def append(self, value: float) -> None:
        self._values.append(value)
        self._median = None

    def __len__(self) -> int:
        return len(self._values)

    def median(self) -> float | None:
        """None when empty."""
        if self._median is None and self._values:
            self._median = statistics.median(self._values)
        return self._median

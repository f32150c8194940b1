"""Admission and order: a bounded waiting queue, and up to ``max_running`` sequences stepped round-robin.

A request waits for at most one step (a decode step or a prefill chunk) of each running sequence. Among
running sequences only those of the lowest ``priority`` value step (vLLM's convention); the others keep
their KV cache and resume when those finish. A background prefill chunk under way stops between two layers
for a request of a lower value (``urgent``), so such a request waits for one layer, not a chunk.
Past ``max_waiting`` queued requests, ``add`` raises ``OverloadedError`` (503). A sequence whose consumer
went away is dropped before its next step.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from common.errors import OverloadedError
from engine.sequence import Sequence


class Scheduler:
    def __init__(
        self, *, max_running: int, max_waiting: int, on_active_change: Callable[[int], None] | None = None
    ) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.on_active_change = on_active_change
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._cond = threading.Condition()
        self._closed = False

    @property
    def active(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._running)

    def add(self, seq: Sequence) -> None:
        with self._cond:
            if len(self._waiting) >= self.max_waiting:
                raise OverloadedError(
                    "the engine's queue is full; retry shortly", headers={"Retry-After": "1"}, code="queue_full"
                )
            self._waiting.append(seq)
            self._cond.notify_all()
        self._changed()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def schedule(self) -> list[Sequence] | None:
        """The sequences to step this round, waiting until there are any; None once closed."""
        with self._cond:
            while not self._closed and not self._waiting and not self._running:
                self._cond.wait()
            if self._closed:
                return None
            while self._waiting and len(self._running) < self.max_running:
                self._running.append(self._waiting.popleft())
            first = min(s.priority for s in self._running)
            return [s for s in self._running if s.priority == first]

    def urgent(self, priority: int) -> bool:
        """Whether a request of a lower priority value than ``priority`` is waiting."""
        with self._cond:
            return any(s.priority < priority for s in self._waiting)

    def finish(self, seq: Sequence) -> None:
        with self._cond:
            self._running.remove(seq)
        seq.cache = None
        self._changed()

    def drop_cancelled(self) -> None:
        """Waiting sequences whose consumer went away never start."""
        with self._cond:
            dropped = [s for s in self._waiting if s.cancelled.is_set()]
            for seq in dropped:
                self._waiting.remove(seq)
        if dropped:
            self._changed()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _changed(self) -> None:
        if self.on_active_change is not None:
            self.on_active_change(self.active)

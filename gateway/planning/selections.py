"""Recent prompts, found by the longest prefix a new prompt shares with them.

The planner keeps the prompts it compressed with what it kept of each (a ``Selection``): a new prompt that
begins like one of them (the next turn of a chat, the next step of an agent, the same document with another
question) can reuse that selection below the point where the two part, so that the engine's prefix cache
serves it. Kept in this process (LRU of ``capacity`` prompts); replicas do not share them, and a replica
without one plans afresh.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from common.blocks import Ints
from common.sequences import longest_prefix

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Selection:
    kept: tuple[int, ...]  # the earlier prompt's kept indices, sorted
    keep_rate: float
    protected: bool  # whether its system prompt was kept whole
    length: int  # the earlier prompt's tokens


class RecentPrompts(Generic[T]):
    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._entries: collections.OrderedDict[int, tuple[np.ndarray, T]] = collections.OrderedDict()
        self._ids = 0
        self._lock = threading.Lock()

    def add(self, token_ids: Ints, value: T) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._ids += 1
            self._entries[self._ids] = (np.asarray(token_ids, dtype=np.int64), value)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def longest_shared(self, token_ids: Ints) -> tuple[T, int] | None:
        """The value whose prompt shares the longest prefix with ``token_ids``, and that prefix's length."""
        query = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            key, shared = longest_prefix(query, ((key, prompt) for key, (prompt, _) in self._entries.items()))
            if key is None:
                return None
            self._entries.move_to_end(key)
            return self._entries[key][1], shared

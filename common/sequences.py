"""How long a prefix two token sequences share: the question behind every reuse of earlier work (the draft's
KV of an earlier prompt, an earlier selection, the engine-cache model's block chains), asked of each recent
prompt on every request."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import numpy as np

FIRST_WINDOW = 256  # tokens compared first: most recent prompts part from a new one early
K = TypeVar("K")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens ``a`` and ``b`` (1-D integer arrays) share. Compared in growing windows, so
    an unrelated prompt costs a few hundred comparisons rather than a pass over both."""
    n = min(a.size, b.size)
    start, window = 0, FIRST_WINDOW
    while start < n:
        end = min(n, start + window)
        differ = np.flatnonzero(a[start:end] != b[start:end])
        if differ.size:
            return start + int(differ[0])
        start, window = end, window * 4
    return n


def longest_prefix(query: np.ndarray, candidates: Iterable[tuple[K, np.ndarray]]) -> tuple[K | None, int]:
    """The key of the candidate sharing the longest prefix with ``query`` (the first of equals, in the order
    given) and that prefix's length; ``(None, 0)`` when none shares a token. A candidate is compared in full
    only if it agrees with ``query`` just past the best so far: one that differs there cannot share more. So
    recent prompts that all begin with one long system prompt or document cost one full comparison, not one
    each (numpy's per-call cost made that a millisecond per request on a 12,000-token prompt)."""
    best_key, best = None, 0
    for key, candidate in candidates:
        if best >= query.size:  # no candidate can share more
            break
        if candidate.size <= best or (best and candidate[best] != query[best]):
            continue
        shared = common_prefix(query, candidate)
        if shared > best:
            best_key, best = key, shared
    return best_key, best

"""How long a prefix two token sequences share: the question behind every reuse of earlier work (the draft's
KV of an earlier prompt, an earlier selection), asked of each recent prompt on every request."""

from __future__ import annotations

import numpy as np

FIRST_WINDOW = 256  # tokens compared first: most recent prompts part from a new one early


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

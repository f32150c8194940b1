"""Recent prompts' draft KV caches, so a prompt that extends one (the same document with a new question,
the next turn of a chat) prefills only its new suffix. LRU, bounded by bytes."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from common.sequences import common_prefix, longest_prefix
from draft_worker.scorer import PromptKV


class PrefixKVCache:
    def __init__(self, max_bytes: int, min_prefix: int = 64, recompute: int = 1) -> None:
        self.recompute = recompute  # the prompt's last tokens always prefilled: their queries are scored
        self.max_bytes = max_bytes
        self.min_prefix = min_prefix
        self._entries: collections.OrderedDict[int, PromptKV] = collections.OrderedDict()
        self._bytes = 0
        self._ids = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def reusable(self, prompt: Sequence[int] | np.ndarray) -> int:
        """How many of the prompt's tokens a lookup would reuse now (0 below ``min_prefix``); changes nothing."""
        query = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            _, best = longest_prefix(query, self._candidates())
        reuse = min(best, len(query) - self.recompute)
        return reuse if reuse >= self.min_prefix else 0

    def lookup(self, prompt: Sequence[int]) -> tuple[PromptKV, int] | None:
        """The entry sharing the longest prefix with ``prompt`` and how many of its tokens to reuse.

        At least the prompt's last ``recompute`` tokens are always prefilled: their queries are scored (the
        last token's, and an observation window's).
        """
        query = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            best_key, best_len = longest_prefix(query, self._candidates())
            reuse = min(best_len, len(query) - self.recompute)
            if best_key is None or reuse < self.min_prefix:
                self.misses += 1
                return None
            self._entries.move_to_end(best_key)
            self.hits += 1
            return self._entries[best_key], reuse

    def _candidates(self) -> Iterator[tuple[int, np.ndarray]]:
        return ((key, entry.token_ids.numpy()) for key, entry in self._entries.items())

    def store(self, kv: PromptKV) -> None:
        size = kv.nbytes
        if size > self.max_bytes:
            return
        tokens = kv.token_ids.numpy()
        with self._lock:
            # an entry whose prompt begins this one's is redundant now: this one serves every lookup it would
            for key in [
                key
                for key, entry in self._entries.items()
                if entry.token_ids.numel() <= tokens.size
                and common_prefix(tokens, entry.token_ids.numpy()) == entry.token_ids.numel()
            ]:
                self._bytes -= self._entries.pop(key).nbytes
            self._ids += 1
            self._entries[self._ids] = kv
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

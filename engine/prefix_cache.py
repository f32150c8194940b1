"""The reference engine's prefix cache, the way vLLM's works.

Full blocks of computed KV, keyed by ``blocks.block_hashes`` (tokens and non-default positions, chained). A new
sequence reuses the longest run of cached leading blocks and prefills only the rest; a finished (or
cancelled) sequence leaves its full blocks behind. Least recently used blocks go first once the cache holds
more than ``max_tokens`` tokens (room for a prompt's new blocks is made when it starts, as vLLM allocates before
it computes); a hit touches a chain from its tail to its head, so a chain's tail is evicted before its head
(as vLLM's free-block queue does), and a head is never orphaned before its tail.
What it stores, evicts and clears goes to ``publish`` as vLLM's KV cache events (``engine.kv_events``).
Used by the engine thread, but for ``clear`` (a lock keeps the two apart).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache, PretrainedConfig

from common.blocks import block_hashes, block_keys, chain, reusable_blocks
from common.kv_cache import append_cache, attention_layers, keys_values
from common.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, Event

Block = torch.Tensor  # every layer's keys and values: [layers, 2, Hkv, block_size, D]


class PrefixCache:
    def __init__(
        self, max_tokens: int, block_size: int = 16, publish: Callable[[list[Event]], None] | None = None
    ) -> None:
        assert block_size > 0 and max_tokens >= 0
        self.block_size = block_size
        self.publish = publish
        self._lock = threading.Lock()
        self.max_blocks = max_tokens // block_size
        self._blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def lookup(
        self, token_ids: Sequence[int], position_ids: Sequence[int], config: PretrainedConfig, reserve: int = 256
    ) -> tuple[DynamicCache | None, int]:
        """A KV cache holding the longest reusable run of cached leading blocks, and how many tokens it holds.
        It has room for the whole prompt and grows by ``reserve`` tokens at a time (``common.kv_cache``)."""
        hashes = block_hashes(token_ids, position_ids, self.block_size)
        found = []
        with self._lock:
            for h in hashes:
                block = self._blocks.get(h)
                if block is None:
                    break
                found.append((h, block))
            found = found[: reusable_blocks(len(found), len(token_ids), self.block_size)]
            for h, _ in reversed(found):  # the head ends up the most recently used
                self._blocks.move_to_end(h)
            # room for the blocks this prompt will leave, made now, as vLLM allocates (and evicts) before it
            # computes: the removals are published before the answer, never just after it
            self._evict(self.max_blocks - (len(hashes) - len(found)))
        self.queries += len(token_ids)
        if not found:
            return None, 0
        # one copy of every block at once: [layers, 2, Hkv, tokens, D] (a cat per layer and per K/V was 16x the
        # calls, and at 12k cached tokens their overhead, not the bytes, took most of a cached request)
        run = torch.cat([b for _, b in found], dim=3)
        layers = [(run[layer, 0][None], run[layer, 1][None]) for layer in range(run.shape[0])]
        n_tokens = len(found) * self.block_size
        self.hits += n_tokens
        return append_cache(config, len(token_ids) + reserve, reserve=reserve, layers=layers), n_tokens

    def store(self, token_ids: Sequence[int], position_ids: Sequence[int], cache: DynamicCache) -> None:
        """Keeps the full blocks of a computed run (``cache`` holds KV for ``token_ids``, in order), at most as
        many leading blocks as the cache holds: the head of a run is its most recently used part, so a longer
        run's tail would be the first to go."""
        n_tokens = min(len(token_ids), cache.get_seq_length(), self.max_blocks * self.block_size)
        keys = block_keys(token_ids[:n_tokens], position_ids[:n_tokens], self.block_size)
        hashes = chain(keys)
        new: list[int] = []
        removed: list[BlockHash] = []
        with self._lock:
            absent = [index for index, h in enumerate(hashes) if h not in self._blocks]
            copies = self._copies(absent, cache)
            for index, h in reversed(list(enumerate(hashes))):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                self._blocks[h] = copies[index]
                new.append(index)
            while len(self._blocks) > self.max_blocks:  # when sequences side by side outgrew their room
                removed.append(self._blocks.popitem(last=False)[0])
            if self.publish is not None and (new or removed):
                events: list[Event] = [self._stored(run, hashes, keys) for run in _runs(sorted(new))]
                self.publish(events + ([BlockRemoved(removed, "GPU")] if removed else []))

    def _copies(self, indices: list[int], cache: DynamicCache, run_blocks: int = 256) -> dict[int, Block]:
        """Each of these blocks' KV as a tensor of its own (evicting one frees it): a run of blocks is gathered
        from every layer in one copy, then cut (one block at a time, every layer's keys and values were 130
        small copies, and a 64-layer model's 128k-token prompt took seconds of the engine's time to store)."""
        out: dict[int, Block] = {}
        size = self.block_size
        for run in _runs(indices):
            for part in range(0, len(run), run_blocks):
                blocks = run[part : part + run_blocks]
                start, end = blocks[0] * size, (blocks[-1] + 1) * size
                gathered = torch.stack(
                    [
                        torch.stack((keys[0, :, start:end], values[0, :, start:end]))
                        for keys, values in map(keys_values, attention_layers(cache))
                    ]
                )  # [layers, 2, Hkv, tokens, D]
                for offset, index in enumerate(blocks):
                    out[index] = gathered[:, :, :, offset * size : (offset + 1) * size].clone()
        return out

    def _evict(self, keep: int) -> None:
        """Least recently used blocks out until at most ``keep`` are left (under the lock)."""
        removed: list[BlockHash] = []
        while len(self._blocks) > max(0, keep):
            removed.append(self._blocks.popitem(last=False)[0])
        if removed and self.publish is not None:
            self.publish([BlockRemoved(removed, "GPU")])

    def clear(self) -> None:
        """Drops every block (vLLM's ``/reset_prefix_cache``)."""
        with self._lock:
            self._blocks.clear()
            if self.publish is not None:
                self.publish([AllBlocksCleared()])

    def _stored(
        self, run: list[int], hashes: list[bytes], keys: list[tuple[np.ndarray, tuple[str] | None]]
    ) -> BlockStored:
        extra = [keys[i][1] for i in run]
        return BlockStored(
            [hashes[i] for i in run],
            hashes[run[0] - 1] if run[0] else None,
            [int(t) for i in run for t in keys[i][0]],
            self.block_size,
            extra if any(e is not None for e in extra) else None,
            "GPU",
        )


def _runs(indices: list[int]) -> list[list[int]]:
    """Sorted indices cut into runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs

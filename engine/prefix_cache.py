"""The reference engine's prefix cache, the way vLLM's works.

Full blocks of computed KV, keyed by ``blocks.block_hashes`` (tokens *and* positions, chained). A new
sequence reuses the longest run of cached leading blocks and prefills only the rest; a finished (or
cancelled) sequence leaves its full blocks behind. Least recently used blocks go first once the cache holds
more than ``max_tokens`` tokens; a hit touches a chain from its tail to its head, so a chain's tail is
evicted before its head (as vLLM's free-block queue does), and a head is never orphaned before its tail.
Used by the engine thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig

from common.kv_cache import append_cache
from engine.blocks import block_hashes, reusable_blocks

Block = torch.Tensor  # every layer's keys and values: [layers, 2, Hkv, block_size, D]


class PrefixCache:
    def __init__(self, max_tokens: int, block_size: int = 16) -> None:
        assert block_size > 0 and max_tokens >= 0
        self.block_size = block_size
        self.max_blocks = max_tokens // block_size
        self._blocks: collections.OrderedDict[bytes, Block] = collections.OrderedDict()
        self.hits = 0  # prompt tokens served from the cache
        self.queries = 0  # prompt tokens looked up

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def lookup(self, token_ids: Sequence[int], position_ids: Sequence[int], config: PretrainedConfig,
               reserve: int = 256) -> tuple[DynamicCache | None, int]:
        """A KV cache holding the longest reusable run of cached leading blocks, and how many tokens it holds.
        It has room for the whole prompt and grows by ``reserve`` tokens at a time (``common.kv_cache``)."""
        hashes = block_hashes(token_ids, position_ids, self.block_size)
        found = []
        for h in hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            found.append((h, block))
        found = found[: reusable_blocks(len(found), len(token_ids), self.block_size)]
        self.queries += len(token_ids)
        if not found:
            return None, 0
        for h, _ in reversed(found):  # the head ends up the most recently used
            self._blocks.move_to_end(h)
        # one copy of every block at once: [layers, 2, Hkv, tokens, D] (a cat per layer and per K/V was 16x the
        # calls, and at 12k cached tokens their overhead, not the bytes, took most of a cached request)
        run = torch.cat([b for _, b in found], dim=3)
        layers = [(run[layer, 0][None], run[layer, 1][None]) for layer in range(run.shape[0])]
        n_tokens = len(found) * self.block_size
        self.hits += n_tokens
        return append_cache(config, len(token_ids) + reserve, reserve=reserve, layers=layers), n_tokens

    def store(self, token_ids: Sequence[int], position_ids: Sequence[int], cache: DynamicCache) -> None:
        """Keeps the full blocks of a computed run (``cache`` holds KV for ``token_ids``, in order)."""
        n_tokens = min(len(token_ids), cache.get_seq_length())
        hashes = block_hashes(token_ids[:n_tokens], position_ids[:n_tokens], self.block_size)
        for index, h in reversed(list(enumerate(hashes))):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            start, end = index * self.block_size, (index + 1) * self.block_size
            self._blocks[h] = torch.stack([torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end]))
                                           for layer in cache.layers])
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

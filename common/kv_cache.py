"""A KV cache layer that appends in place.

transformers' ``DynamicLayer`` appends a forward's keys and values with ``torch.cat``: a copy of the layer's
whole cache per forward. Scoring a prompt that extends a cached one runs 8 forwards over a cache of
thousands of tokens (the new suffix, then each look-ahead token), so the copies cost more than the
forwards' own work. This layer writes into a buffer with room to spare and hands out views of it, as
vLLM's and nano-vllm's preallocated KV blocks do. The first write reserves ``capacity`` positions (the run's
whole length when the caller knows it); when the room runs out the buffer grows to what is needed plus
``reserve``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer


class AppendLayer(DynamicLayer):
    """``DynamicLayer`` whose ``keys`` and ``values`` are views of a buffer with room to append."""

    def __init__(
        self, capacity: int = 0, reserve: int = 16, storage: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.capacity = capacity
        self.reserve = reserve
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._storage = storage  # buffers to write into instead of new ones (a CUDA graph reads them too)
        self._length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if self._keys is None and self._storage is not None and _fits(self._storage[0], key_states, end):
            self._keys, self._values = self._storage
        if self._keys is None or self._values is None or end > self._keys.shape[-2]:
            self._grow(key_states, value_states, max(end + self.reserve, self.capacity))
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self._length = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        batch, heads, _, key_dim = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, key_dim)
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if self._length and self._keys is not None and self._values is not None:
            keys[:, :, : self._length] = self._keys[:, :, : self._length]
            values[:, :, : self._length] = self._values[:, :, : self._length]
        self._keys, self._values = keys, values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self.keys is not None:
            self._length = self.keys.shape[-2]

    def reset(self) -> None:
        super().reset()
        self._keys = self._values = None
        self._length = 0


def _fits(buffer: torch.Tensor, states: torch.Tensor, length: int) -> bool:
    return (
        buffer.shape[:2] == states.shape[:2]
        and buffer.shape[-1] == states.shape[-1]
        and buffer.shape[-2] >= length
        and buffer.dtype == states.dtype
        and buffer.device == states.device
    )


def append_cache(
    config: PretrainedConfig,
    capacity: int = 0,
    *,
    reserve: int = 16,
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    storage: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers append in place, room for ``capacity``
    tokens made at the first write (or, where they fit, in ``storage``: per layer, key and value buffers
    [B, Hkv, room, D] that outlive the cache), holding ``layers``' keys and values (copied in) when given.
    Sliding-window layers, if any, stay as transformers makes them."""
    cache = DynamicCache(config=config)
    buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [*storage] if storage else [None] * len(cache.layers)
    cache.layers = [
        AppendLayer(capacity, reserve, held) if type(layer) is DynamicLayer else layer
        for layer, held in zip(cache.layers, buffers)
    ]
    for layer, (keys, values) in zip(cache.layers, layers or ()):
        layer.update(keys, values)  # type: ignore[union-attr]  # every layer a full-attention model has
    return cache


def attention_layers(cache: Cache) -> list[DynamicLayer]:
    """The cache's layers as the attention layers this project's models have (keys, values, crop): transformers
    types them as any of its kinds, linear-attention and placeholder ones too."""
    return cast("list[DynamicLayer]", cache.layers)


def keys_values(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values [B, Hkv, S, D]."""
    keys, values = layer.keys, layer.values
    if keys is None or values is None:
        raise ValueError("the KV cache layer holds nothing yet")
    return keys, values

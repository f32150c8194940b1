"""Forward passes of the target model at explicit positions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from common.kv_cache import append_cache, attention_layers
from common.models import with_cache

DECODE_ROOM = 256  # tokens of room a sequence's KV cache grows by: one copy of the cache per 256 decode steps


class Yielded(Exception):
    """A prefill stopped between two layers because something more urgent is waiting; its cache is as before."""


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache | None = None,
    capacity: int = 0,
    *,
    should_yield: Callable[[], bool] | None = None,
) -> tuple[torch.Tensor, DynamicCache]:
    """Runs prompt tokens at their original positions into the KV cache (a fresh one with room for
    ``capacity`` tokens, or ``cache`` to continue a chunked prefill); the cache holds only the tokens given,
    never the gaps between their positions.

    input_ids, position_ids: [1, K]; returns last-token logits [V] (float32) and the cache.
    The explicit all-ones mask plus a cache keeps transformers from reading gapped positions as packed
    sequences: the causal mask is by index (kept token i sees kept tokens <= i), RoPE by position.
    ``should_yield`` is asked before each decoder layer: True stops the forward there (``Yielded``), the layers
    that ran cropped back out of ``cache``, so that the chunk can run again later from the start.
    """
    cache = cache if cache is not None else append_cache(model.config, capacity, reserve=DECODE_ROOM)
    past = cache.get_seq_length()
    try:
        with _yielding(model, should_yield):
            out = model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=torch.ones(1, past + input_ids.shape[1], dtype=torch.long, device=input_ids.device),
                **with_cache(model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
    except Yielded:
        for layer in attention_layers(cache):  # the layers before the stop hold the chunk; the others do not
            if (extra := layer.get_seq_length() - past) > 0:
                layer.crop(-extra)
        raise
    return out.logits[0, -1].float(), cache


@contextlib.contextmanager
def _yielding(model: PreTrainedModel, should_yield: Callable[[], bool] | None) -> Iterator[None]:
    if should_yield is None:
        yield
        return

    def check(module: torch.nn.Module, args: Any) -> None:
        if should_yield():
            raise Yielded

    handles = [layer.register_forward_pre_hook(check) for layer in model.get_decoder().layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def decode_one(model: PreTrainedModel, token: torch.Tensor, position: int, cache: DynamicCache) -> torch.Tensor:
    """One decode step. token: 0-d; position: where it stands. Returns logits [V] (float32)."""
    out = model(
        input_ids=token.view(1, 1),
        position_ids=torch.tensor([[position]], device=token.device),
        **with_cache(model, cache),
        use_cache=True,
    )
    logits: torch.Tensor = out.logits
    return logits[0, -1].float()

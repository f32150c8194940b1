"""Forward passes of the target model at explicit positions."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from common.kv_cache import append_cache
from common.models import with_cache

DECODE_ROOM = 256  # tokens of room a sequence's KV cache grows by: one copy of the cache per 256 decode steps


@torch.inference_mode()
def prefill(
    model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache | None = None,
    capacity: int = 0,
) -> tuple[torch.Tensor, DynamicCache]:
    """Runs prompt tokens at their original positions into the KV cache (a fresh one with room for
    ``capacity`` tokens, or ``cache`` to continue a chunked prefill); the cache holds only the tokens given,
    never the gaps between their positions.

    input_ids, position_ids: [1, K]; returns last-token logits [V] (float32) and the cache.
    The explicit all-ones mask plus a cache keeps transformers from reading gapped positions as packed
    sequences: the causal mask is by index (kept token i sees kept tokens <= i), RoPE by position.
    """
    cache = cache if cache is not None else append_cache(model.config, capacity, reserve=DECODE_ROOM)
    past = cache.get_seq_length()
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=torch.ones(1, past + input_ids.shape[1], dtype=torch.long, device=input_ids.device),
        **with_cache(model, cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[0, -1].float(), cache


@torch.inference_mode()
def decode_one(model: PreTrainedModel, token: torch.Tensor, position: int, cache: DynamicCache) -> torch.Tensor:
    """One decode step. token: 0-d; position: where it stands. Returns logits [V] (float32)."""
    out = model(
        input_ids=token.view(1, 1),
        position_ids=torch.tensor([[position]], device=token.device),
        **with_cache(model, cache),
        use_cache=True,
    )
    return out.logits[0, -1].float()

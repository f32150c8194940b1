"""Forward passes of the target model at explicit positions."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


@torch.inference_mode()
def prefill(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    """Runs the kept tokens at their original positions into a fresh KV cache of K entries.

    input_ids, position_ids: [1, K]; returns last-token logits [V] (float32) and the cache.
    The explicit all-ones mask plus a cache keeps transformers from reading gapped positions as packed
    sequences: the causal mask is by index (kept token i sees kept tokens <= i), RoPE by position.
    """
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=torch.ones_like(input_ids),
        past_key_values=cache,
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
        past_key_values=cache,
        use_cache=True,
    )
    return out.logits[0, -1].float()

"""Query capture: how the scorer sees attention without an S×S matrix.

Fused attention kernels (SDPA, flash attention) do not return attention weights, and asking transformers
for them (``output_attentions=True``) builds an S×S matrix per layer. Instead the model's own kernel is
wrapped: a forward given a ``QueryRecorder`` records the queries of its last ``window`` positions in every
layer (the last one, but in a prefill with an observation window), and the scorer reads the keys back from
the KV cache (stored after RoPE). Plain forwards run the original
kernel unchanged. The wrapped kernel is registered when a model is prepared, never at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from common.attention import local_causal_attention

CAPTURE_PREFIX = "specprefill_capture_"


@dataclass
class QueryRecorder:
    """Collects, per layer, the queries of the last ``window`` positions of every forward it is passed to."""

    window: int = 1
    local_attention: int = 0
    """A prompt's forward (more than one query, no mask) attends locally within this many keys (0: in full)."""
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)

    def record(self, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
        """query: [B, H, Q, D], often a view of the forward's queries. Kept as a copy: a view of the last
        positions would keep the whole prompt's queries alive (on an 8k-token prompt through a Llama-3.2-1B
        shape, 2/3 of a plain prefill's peak memory more)."""
        self.queries.setdefault(layer_idx, []).append(query.clone())
        self.scaling[layer_idx] = scaling

    def layer_queries(self, layer_idx: int) -> torch.Tensor:
        return torch.cat(self.queries[layer_idx], dim=2)  # [B, H, Q, D]


def _capturing_attention(inner: Callable[..., Any]) -> Callable[..., Any]:
    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        specprefill_recorder: QueryRecorder | None = None,
        **kwargs: Any,
    ) -> Any:
        if specprefill_recorder is not None:
            scaling = float(kwargs.get("scaling") or int(getattr(module, "head_dim")) ** -0.5)
            window = specprefill_recorder.window
            specprefill_recorder.record(int(getattr(module, "layer_idx")), query[:, :, -window:, :], scaling)
            local = specprefill_recorder.local_attention
            if local and query.shape[2] > 1 and getattr(module, "is_causal", True):
                mask = attention_mask[..., : key.shape[2]] if attention_mask is not None else None
                return local_causal_attention(query, key, value, local, scaling, mask=mask), None
        return inner(module, query, key, value, attention_mask, **kwargs)

    return attention


def enable_query_capture(model: PreTrainedModel) -> None:
    """Wraps the model's attention kernel so that scoring forwards can record queries. Idempotent."""
    current = model.config._attn_implementation
    if current.startswith(CAPTURE_PREFIX):
        return
    name = CAPTURE_PREFIX + current
    AttentionInterface.register(name, _capturing_attention(ALL_ATTENTION_FUNCTIONS[current]))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)


def captures_queries(model: PreTrainedModel) -> bool:
    return str(model.config._attn_implementation).startswith(CAPTURE_PREFIX)

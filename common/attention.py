"""SDPA with grouped-query attention done by the kernel, not by copying keys and values.

transformers' ``sdpa`` attention hands grouped-query models (Llama 3: 8 query heads per KV head) to
``scaled_dot_product_attention(enable_gqa=True)`` only without an attention mask. Otherwise it first repeats
every layer's keys and values once per query head (``repeat_kv``): a copy of the whole KV cache, times the
group size, per layer and per forward. Every forward here has a mask (kept tokens at gapped positions need
one): with 12,000 cached tokens, a 5-token prefill on the demo target took 56-62 ms, and 31 ms with the
kernel's own GQA (a cold prefill, whose attention dwarfs the copy, is unchanged).

On the CPU, PyTorch's fused kernel takes a mask and ``enable_gqa`` together. On CUDA it does not (it would
fall back to the math kernel, which builds the attention matrix), so there this is plain ``sdpa``. The
kernel is registered when a model is loaded, never at import.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

GQA_SDPA = "specprefill_gqa_sdpa"


def gqa_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query: [B, Hq, Q, D]; key, value: [B, Hkv, K, D]; returns [B, Q, Hq, D] as transformers' kernels do."""
    # without a mask transformers already lets the kernel do GQA; CUDA, paged caches and position biases: as is
    if (attention_mask is None or query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1
            or kwargs.get("cache") is not None or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def use_gqa_sdpa(model: PreTrainedModel) -> None:
    """Switches a model on plain ``sdpa`` to the kernel above (others, as ``eager``, are left alone)."""
    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(GQA_SDPA)

"""SDPA with grouped-query attention done by the kernel, not by copying keys and values.

transformers' ``sdpa`` attention hands grouped-query models (Llama 3: 8 query heads per KV head) to
``scaled_dot_product_attention(enable_gqa=True)`` only without an attention mask. Otherwise it first repeats
every layer's keys and values once per query head (``repeat_kv``): a copy of the whole KV cache, times the
group size, per layer and per forward. Every forward here has a mask (kept tokens at gapped positions need
one): with 12,000 cached tokens, a 5-token prefill on the demo target took 56-62 ms, and 31 ms with the
kernel's own GQA (a cold prefill, whose attention dwarfs the copy, is unchanged).

On the CPU, PyTorch's fused kernel takes a mask and ``enable_gqa`` together. On CUDA it does not (it would
fall back to the math kernel, which builds the attention matrix), so there this is plain ``sdpa``, except
for one new token with a mask (a decode step, the draft's look-ahead): SDPA's kernels split that work by
query and head only, 32 blocks for a 4-query-group, 8-KV-head model, each streaming the whole cache, on a
chip with 132 multiprocessors; two matrix products (``decode_attention``) spread the keys over all of them.
A chunk of a prompt after a cached prefix (a chunked prefill, a prompt that extends a cached one) is causal
over the whole cache, aligned at its end. transformers makes that a [Q, K] boolean mask, which on CUDA takes
the memory-efficient kernel, after copying the cache once per query group. Where nothing is masked but
causality, the mask interface here leaves the mask out on CUDA, and the attention runs SDPA's lower-right
causal form (``causal_lower_right``: the flash kernel, which does the grouped heads itself). On the CPU, whose
flash kernel takes no lower-right form, such a chunk is two calls of it, merged by their log-sum-exps
(``split_causal_attention``): a masked call computes every block of [Q, K], and a chunked prefill on 2 cores spent
most of its attention time so. That holds for kept tokens at gapped positions too: their causal order is by
index, and positions only turn RoPE.

The kernel is registered when a model is loaded, never at import.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, causal_mask_function

GQA_SDPA = "specprefill_gqa_sdpa"
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()  # torch.bmm(..., out_dtype=): recent PyTorch only


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [B, Hq, Q, D]; key, value: [B, Hkv, K, D]; returns [B, Q, Hq, D] as transformers' kernels do."""
    plain = kwargs.get("cache") is None and kwargs.get("position_bias") is None and not dropout
    if plain and attention_mask is not None and query.device.type == "cuda" and query.shape[2] == 1:
        return decode_attention(query, key, value, attention_mask, scaling), None
    if plain and attention_mask is None and 1 < query.shape[2] < key.shape[2] and getattr(module, "is_causal", True):
        # a chunk after a cache, its mask left out (below)
        if query.device.type == "cpu":
            return split_causal_attention(query, key, value, scaling), None
        return lower_right_causal_attention(module, query, key, value, scaling), None
    # without a mask transformers already lets the kernel do GQA; CUDA, paged caches and position biases: as is
    if (
        attention_mask is None
        or query.device.type != "cpu"
        or getattr(module, "num_key_value_groups", 1) == 1
        or not plain
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def lower_right_causal_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None = None
) -> torch.Tensor:
    """Causal attention of the last Q of K positions: query i sees keys 0..K-Q+i. query: [B, Hq, Q, D]; key,
    value: [B, Hkv, K, D]; returns [B, Q, Hq, D]. The flash kernel where it runs (it aligns a causal mask at the
    end of the keys); elsewhere the mask made and handed to transformers' kernel choice, as before."""
    q_length, kv_length = query.shape[2], key.shape[2]
    grouped = query.shape[1] != key.shape[1]
    params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, False, grouped)
    if query.device.type == "cuda" and torch.backends.cuda.can_use_flash_attention(params):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(q_length, kv_length), scale=scaling, enable_gqa=grouped
        )
        return out.transpose(1, 2).contiguous()
    mask = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device).tril(kv_length - q_length)
    return sdpa_attention_forward(module, query, key, value, mask[None, None], scaling=scaling, is_causal=False)[0]


def split_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None = None
) -> torch.Tensor:
    """Causal attention of the last Q of K positions on the CPU, as two calls of its flash kernel merged by their
    log-sum-exps: every query sees all the keys before its chunk (nothing masked), and the chunk's own keys
    causally (a square causal block, whose masked half the kernel skips). One masked call over [Q, K] computes
    every block, masked or not, reading the mask as it goes: for a whole 8,000-token causal mask on 2 cores
    (bfloat16, a 0.5B model's heads) 0.90 s a layer against 0.32 s with the kernel's own causal mode. query:
    [B, Hq, Q, D]; key, value: [B, Hkv, K, D] (grouped heads: the kernel's own); returns [B, Q, Hq, D]."""
    prefix = key.shape[2] - query.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    own, own_lse = flash(query, key[:, :, prefix:], value[:, :, prefix:], 0.0, True, scale=scaling)
    before, before_lse = flash(query, key[:, :, :prefix], value[:, :, :prefix], 0.0, False, scale=scaling)
    lse = torch.logaddexp(own_lse, before_lse)  # [B, Hq, Q], float32
    out = own.float() * (own_lse - lse).exp()[..., None] + before.float() * (before_lse - lse).exp()[..., None]
    merged: torch.Tensor = out.to(query.dtype).transpose(1, 2).contiguous()
    return merged


ATTENTION_SINKS = 4
"""Keys every query of a local attention sees whatever its window: the prompt's first tokens, on which a trained
model's attention piles up (StreamingLLM's attention sinks, Xiao et al., 2024, keep 4)."""


def local_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window: int,
    scaling: float | None = None,
    block: int = 512,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the last Q of K positions in which each query sees only the ``ATTENTION_SINKS`` first
    keys, the ``window`` keys before its block of ``block`` queries and its block's keys up to its own: linear in
    K for a fixed window, where full causal attention is quadratic. Blocks are aligned to absolute positions
    (multiples of ``block`` from the first key), so a prompt read after a cached prefix sees what it would have
    seen read at once. query: [B, Hq, Q, D]; key, value: [B, Hkv, K, D]; returns [B, Q, Hq, D]. On the CPU each
    block is ``split_causal_attention`` over its keys (two flash calls); elsewhere one masked SDPA call over
    [block, window + block] (never a [Q, K] mask). ``mask`` (boolean or additive, [B or 1, 1 or Hq, Q, K]):
    what another kernel was given, applied too, block by block (the masked call then)."""
    q_length, k_length = query.shape[2], key.shape[2]
    offset = k_length - q_length  # the absolute position of the first query
    grouped = query.shape[1] != key.shape[1]
    outs = []
    start = offset
    while start < k_length:
        stop = min(k_length, (start // block + 1) * block)
        low = max(ATTENTION_SINKS, (start // block) * block - window)
        sinks = min(ATTENTION_SINKS, low)
        keys = torch.cat([key[:, :, :sinks], key[:, :, low:stop]], dim=2) if sinks else key[:, :, low:stop]
        values = torch.cat([value[:, :, :sinks], value[:, :, low:stop]], dim=2) if sinks else value[:, :, low:stop]
        part = query[:, :, start - offset : stop - offset]
        given = None
        if mask is not None:
            rows = mask[..., start - offset : stop - offset, :]
            given = torch.cat([rows[..., :sinks], rows[..., low:stop]], dim=-1) if sinks else rows[..., low:stop]
        if given is not None:
            seen = torch.ones(part.shape[2], keys.shape[2], dtype=torch.bool, device=query.device)
            causal = seen.tril(keys.shape[2] - part.shape[2])
            both = given & causal if given.dtype == torch.bool else given.masked_fill(~causal, float("-inf"))
            out = torch.nn.functional.scaled_dot_product_attention(
                part, keys, values, attn_mask=both, scale=scaling, enable_gqa=grouped
            )
            outs.append(out.transpose(1, 2))
        elif keys.shape[2] == part.shape[2]:  # the first block: plain causal attention
            out = torch.nn.functional.scaled_dot_product_attention(
                part, keys, values, is_causal=True, scale=scaling, enable_gqa=grouped
            )
            outs.append(out.transpose(1, 2))
        elif query.device.type == "cpu":
            outs.append(split_causal_attention(part, keys, values, scaling))
        else:
            seen = torch.ones(part.shape[2], keys.shape[2], dtype=torch.bool, device=query.device)
            mask = seen.tril(keys.shape[2] - part.shape[2])
            out = torch.nn.functional.scaled_dot_product_attention(
                part, keys, values, attn_mask=mask, scale=scaling, enable_gqa=grouped
            )
            outs.append(out.transpose(1, 2))
        start = stop
    return torch.cat(outs, dim=1).contiguous()


def end_aligned_causal_mask(**kwargs: Any) -> torch.Tensor | None:
    """transformers' SDPA mask (its mask interface, called with keywords), except that a plain causal mask whose
    queries are the last ``q_length`` of the keys, with no padding, is left out (None) whatever the query's
    length: ``gqa_sdpa_attention`` runs it as ``lower_right_causal_attention`` (CUDA) or
    ``split_causal_attention`` (CPU). transformers itself leaves it out only for one query or for no cache
    (there both alignments agree)."""
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    q_offset, q_length = kwargs.get("q_offset"), kwargs.get("q_length")
    kv_offset, kv_length = kwargs.get("kv_offset", 0), kwargs.get("kv_length")
    if not (
        torch.device(kwargs.get("device", "cpu")).type in ("cuda", "cpu")
        and kwargs.get("allow_is_causal_skip", True)
        and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        and kwargs.get("local_size") is None
        and isinstance(q_offset, int)
        and isinstance(q_length, int)
        and isinstance(kv_offset, int)
        and isinstance(kv_length, int)
        and q_offset + q_length == kv_offset + kv_length
    ):
        return cast("torch.Tensor | None", sdpa_mask(**kwargs))
    padding = kwargs.get("attention_mask")  # [B, kv_offset + kv_length] (or None): 0 on padding
    if padding is not None and (padding.shape[-1] != kv_offset + kv_length or not bool(padding[:, kv_offset:].all())):
        return cast("torch.Tensor | None", sdpa_mask(**kwargs))
    return None


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention of one query position as two matrix products, softmax in float32. query: [B, Hq, 1, D]; key,
    value: [B, Hkv, K, D]; attention_mask: boolean (True: attend) or additive, broadcastable to [B, 1, 1, K].
    Returns [B, 1, Hq, D]."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # query head h reads kv head h // group
    logits = float_logits(grouped, key) * (scaling if scaling is not None else dim**-0.5)  # [B, Hkv, G, K]
    mask = attention_mask[..., : key.shape[-2]]
    if mask.dtype == torch.bool:
        logits = logits.masked_fill(~mask, float("-inf"))
    else:
        logits = logits + mask.float()
    probs = torch.softmax(logits, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, G, D]
    return out.reshape(batch, 1, heads, dim)


def float_logits(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """queries @ keysᵀ in float32: [..., Q, D] x [..., K, D] -> [..., Q, K]. On CUDA, half-precision operands go
    to the matrix units as they are, with float32 products (``out_dtype``): the same sums as upcasting first,
    without a float32 copy of the keys (on an H100, a Llama-3.2-1B-shaped draft's look-ahead step spent a
    third of its attention time making that copy, and ran the product on the float32 cores)."""
    if (
        _BMM_OUT_DTYPE
        and queries.device.type == "cuda"
        and keys.dtype in (torch.bfloat16, torch.float16)
        and queries.dtype == keys.dtype
    ):
        lead = torch.broadcast_shapes(queries.shape[:-2], keys.shape[:-2])
        q = queries.expand(*lead, *queries.shape[-2:]).reshape(-1, *queries.shape[-2:])
        k = keys.expand(*lead, *keys.shape[-2:]).reshape(-1, *keys.shape[-2:])
        return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32).view(*lead, q.shape[-2], k.shape[-2])
    return torch.matmul(queries.float(), keys.float().transpose(-1, -2))


def avoid_cudnn_sdpa() -> None:
    """Takes cuDNN out of SDPA's backends (process-wide; called when a model is loaded on CUDA). PyTorch tries
    cuDNN first on Hopper for attention with a mask, and cuDNN builds an execution plan for every shape it has
    not seen, 0.4-1 s of host time each: every prompt length, every chunk, every decode step's cache length
    is a new shape in serving. Measured on an H100 with a Llama-3.2-1B-shaped draft: a 16k-token prompt
    scored in 0.8-1.3 s the first time at each length and 0.16 s after; flash and memory-efficient attention
    have no per-shape cost."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def use_gqa_sdpa(model: PreTrainedModel) -> None:
    """Switches a model on plain ``sdpa`` to the kernel above (others, as ``eager``, are left alone)."""
    if model.config._attn_implementation != "sdpa":
        return
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, end_aligned_causal_mask)
    model.set_attn_implementation(GQA_SDPA)

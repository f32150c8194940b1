"""Token importance from the draft model's attention, as in SpecPrefill.

One draft prefill over the prompt, then greedy look-ahead. For every layer and head, the queries of the
last prompt token and of the look-ahead tokens attend to the *prompt keys only*:
softmax(q·kᵀ·scale) in float32, average-pooled along the sequence, max over layers × heads, mean over
the queries. One score per prompt token.

Memory stays O(S). Fused attention kernels do not return attention weights, and asking transformers for
them (``output_attentions=True``) would build an S×S matrix per layer. Instead the prefill runs with the
model's own kernel (SDPA, flash attention), a thin wrapper records the few queries scored, and the keys
are read back from the KV cache (they are stored after RoPE). Scoring then costs one plain prefill plus
``look_ahead - 1`` single-token decode steps plus a [queries × S] product per layer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from draft_worker.config import ScoringConfig
from draft_worker.loader import eos_token_ids

CAPTURE_PREFIX = "specprefill_capture_"


@dataclass
class QueryRecorder:
    """Collects, per layer, the query of the last position of every forward it is passed to."""

    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)

    def record(self, layer_idx: int, query: torch.Tensor, scaling: float) -> None:
        # query: [B, H, 1, D]
        self.queries.setdefault(layer_idx, []).append(query)
        self.scaling[layer_idx] = scaling

    def layer_queries(self, layer_idx: int) -> torch.Tensor:
        return torch.cat(self.queries[layer_idx], dim=2)  # [B, H, Q, D]


def _capturing_attention(inner: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, specprefill_recorder=None, **kwargs):
        if specprefill_recorder is not None:
            scaling = kwargs.get("scaling") or module.head_dim**-0.5
            specprefill_recorder.record(module.layer_idx, query[:, :, -1:, :], scaling)
        return inner(module, query, key, value, attention_mask, **kwargs)

    return attention


def enable_query_capture(model: PreTrainedModel) -> None:
    """Wraps the model's attention kernel so that scoring forwards can record queries.

    Idempotent. Plain forwards (no recorder passed) run the original kernel unchanged.
    """
    current = model.config._attn_implementation
    if current.startswith(CAPTURE_PREFIX):
        return
    name = CAPTURE_PREFIX + current
    AttentionInterface.register(name, _capturing_attention(ALL_ATTENTION_FUNCTIONS[current]))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)


def model_identity(model: PreTrainedModel, name: str) -> str:
    """A short hash naming these exact weights: the name, the config, every tensor's name, shape and dtype,
    and a sample of its values (so two random inits of one config differ). Part of every score-cache key."""
    digest = hashlib.sha256(name.encode())
    digest.update(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for param_name, tensor in model.state_dict().items():
            sample = tensor.flatten()[:64].float().cpu().numpy().tobytes()
            digest.update(f"{param_name}:{tuple(tensor.shape)}:{tensor.dtype}".encode() + sample)
    return digest.hexdigest()[:16]


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
    input_ids = input_ids.to(device)
    if min(lengths) == width:
        return input_ids, None, None
    mask = (torch.arange(width) >= torch.tensor([width - n for n in lengths])[:, None]).long().to(device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, mask, position_ids


@dataclass
class PromptKV:
    """One prompt's draft KV cache (keys after RoPE), kept so that prompts extending it skip its prefill."""

    token_ids: torch.Tensor  # [L] int64, on CPU
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values): [1, Hkv, L, D]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers) + self.token_ids.nbytes


@torch.inference_mode()
def score_prompts(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: ScoringConfig,
    *,
    prefix: PromptKV | None = None,
    prefix_len: int = 0,
    return_kv: bool = False,
) -> tuple[list[torch.Tensor], list[PromptKV] | None]:
    """Scores every token of each prompt in one batched draft run: float32 CPU tensors, one per prompt.

    Batched prompts are left-padded so that every row's last prompt token sits at index -1; padded keys get
    zero probability, which matches zero padding in the pooling exactly, so a batch scores like single runs.
    With ``prefix`` (one prompt only), its first ``prefix_len`` KV entries stand in for the prompt's first
    ``prefix_len`` tokens, which must be the same tokens: only the rest is prefilled.
    With ``return_kv``, each prompt's KV cache (prompt entries only) comes back for reuse.
    The model must have had ``enable_query_capture`` applied.
    """
    assert model.config._attn_implementation.startswith(CAPTURE_PREFIX), "call enable_query_capture first"
    assert all(len(p) > 0 for p in prompts), "empty prompt"
    device = model.device
    if prefix is not None:
        assert len(prompts) == 1 and 0 < prefix_len < len(prompts[0])
        width = len(prompts[0])
        cache = DynamicCache(
            ddp_cache_data=[(k[:, :, :prefix_len], v[:, :, :prefix_len]) for k, v in prefix.layers],
            config=model.config,
        )
        input_ids = torch.tensor([prompts[0][prefix_len:]], device=device)
        position_ids = torch.arange(prefix_len, width, device=device)[None]
        attention_mask = None
    else:
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        input_ids, attention_mask, position_ids = _left_pad(prompts, pad_id, device)
        width = input_ids.shape[1]
        cache = DynamicCache(config=model.config)
    batch = len(prompts)

    recorder = QueryRecorder()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        specprefill_recorder=recorder,
    )

    eos = torch.tensor(eos_token_ids(model), dtype=torch.long, device=device)
    valid = torch.ones(batch, config.look_ahead, dtype=torch.bool, device=device)  # [B, Q]
    next_pos = torch.tensor([len(p) for p in prompts], device=device)[:, None]  # [B, 1]
    for step in range(1, config.look_ahead):
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        # a query is dropped once its row has generated EOS (the EOS token's own query included)
        valid[:, step] = valid[:, step - 1] & ~torch.isin(token[:, 0], eos)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=-1)
        out = model(
            input_ids=token,
            attention_mask=attention_mask,
            position_ids=next_pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            specprefill_recorder=recorder,
        )
        next_pos = next_pos + 1

    key_pad = None
    if attention_mask is not None:
        key_pad = attention_mask[:, None, None, :width] == 0  # [B, 1, 1, S]
    scores = None
    for layer_idx, layer_cache in enumerate(cache.layers):
        keys = layer_cache.keys[:, :, :width, :].float()  # [B, Hkv, S, D]
        queries = recorder.layer_queries(layer_idx).float()  # [B, H, Q, D]
        pooled = _layer_attention(queries, keys, recorder.scaling[layer_idx], key_pad, config.pool_kernel)
        layer_max = pooled.amax(dim=1)  # [B, Q, S]
        scores = layer_max if scores is None else torch.maximum(scores, layer_max)

    weights = valid.float()  # [B, Q]
    token_scores = (scores * weights[:, :, None]).sum(1) / weights.sum(1, keepdim=True)  # [B, S]
    token_scores = token_scores.cpu()
    results = [token_scores[row, width - len(p) :] for row, p in enumerate(prompts)]
    kvs = _prompt_kvs(cache, prompts, width) if return_kv else None
    return results, kvs


def _prompt_kvs(cache: DynamicCache, prompts: Sequence[Sequence[int]], width: int) -> list[PromptKV]:
    """Each row's prompt entries, without padding or look-ahead; rows of a batch are copied out of it."""
    kvs = []
    for row, prompt in enumerate(prompts):
        start = width - len(prompt)
        layers = []
        for layer in cache.layers:
            k = layer.keys[row : row + 1, :, start:width]
            v = layer.values[row : row + 1, :, start:width]
            if len(prompts) > 1:
                k, v = k.clone(), v.clone()
            layers.append((k, v))
        kvs.append(PromptKV(torch.tensor(list(prompt), dtype=torch.long), layers))
    return kvs


def _layer_attention(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, key_pad: torch.Tensor | None, pool_kernel: int
) -> torch.Tensor:
    """Softmax over the prompt keys, pooled along the sequence.

    queries: [B, H, Q, D]; keys: [B, Hkv, S, D]; returns [B, H, Q, S].
    GQA: query head h reads kv head h // (H / Hkv), as ``repeat_kv`` does; grouping the queries avoids
    materialising repeated keys.
    """
    batch, heads, n_queries, dim = queries.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    grouped = queries.reshape(batch, kv_heads, (heads // kv_heads) * n_queries, dim)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)) * scaling  # [B, Hkv, G*Q, S]
    if key_pad is not None:
        logits = logits.masked_fill(key_pad, float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    probs = probs.reshape(batch, heads * n_queries, width)
    if pool_kernel > 1:
        probs = F.avg_pool1d(probs, kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)
    return probs.reshape(batch, heads, n_queries, width)

"""Token importance from the draft model's attention, as in SpecPrefill.

One draft prefill over the prompt, then greedy look-ahead. For every layer and head, the queries of the
last prompt token and of the look-ahead tokens attend to the *prompt keys only*:
softmax(q·kᵀ·scale) in float32, average-pooled along the sequence, max over layers × heads, mean over
the queries. One score per prompt token. With an observation window (an option, not the paper's), the
queries of the prompt's tokens before its last join them, each over the keys up to its own.

Memory stays O(S) (see ``capture``): scoring costs one plain prefill plus ``look_ahead - 1`` single-token
decode steps plus a [queries × S] product per layer. ``score_prompts`` reads as its three phases:
``prefill``, ``look_ahead``, ``reduce_scores``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from transformers import DynamicCache, PreTrainedModel

from common.attention import float_logits
from common.kv_cache import append_cache, attention_layers, keys_values
from common.models import eos_token_ids, with_cache
from draft_worker.capture import QueryRecorder, captures_queries
from draft_worker.config import ScoringConfig
from draft_worker.graphs import LookAheadGraphs
from draft_worker.propagation import chosen_tokens, propagated_prefill


@dataclass
class PromptKV:
    """One prompt's draft KV cache (keys after RoPE), kept so that prompts extending it skip its prefill."""

    token_ids: torch.Tensor  # [L] int64, on CPU
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values): [1, Hkv, L, D]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers) + self.token_ids.nbytes


@dataclass
class ScoringBatch:
    """One scoring run's inputs and state. Rows are left-padded, so every prompt's last token is at index -1."""

    lengths: list[int]  # each prompt's length
    width: int  # S: the longest prompt; the scored keys are cache entries [0, S)
    input_ids: torch.Tensor  # [B, T]: the tokens to prefill (T = S, or the suffix after a reused prefix)
    position_ids: torch.Tensor | None  # [B, T]
    attention_mask: torch.Tensor | None  # [B, S + steps so far]: 0 on padding; None without padding
    cache: DynamicCache
    propagated: torch.Tensor | None = None  # [S']: the prompt tokens in the cache from layer ``propagate_layer`` on
    propagate_layer: int = 0


@torch.inference_mode()
def score_prompts(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: ScoringConfig,
    *,
    prefix: PromptKV | None = None,
    prefix_len: int = 0,
    return_kv: bool = False,
    graphs: LookAheadGraphs | None = None,
) -> tuple[list[torch.Tensor], list[PromptKV] | None]:
    """Scores every token of each prompt in one batched draft run: float32 CPU tensors, one per prompt.

    Padded keys get zero probability, which matches zero padding in the pooling exactly, so a batch scores
    like single runs (with ``config.local_attention``, whose blocks are aligned to unpadded positions, they are
    single runs). With ``prefix`` (one prompt only), its first ``prefix_len`` KV entries stand in for the
    prompt's first ``prefix_len`` tokens, which must be the same tokens: only the rest is prefilled.
    With ``return_kv``, each prompt's KV cache (prompt entries only) comes back for reuse.
    With ``graphs`` (a model on CUDA), a single prompt's look-ahead steps replay CUDA graphs.
    The model must have had ``enable_query_capture`` applied.
    """
    assert captures_queries(model), "call enable_query_capture first"
    assert all(len(p) > 0 for p in prompts), "empty prompt"
    if config.propagate_layer:  # one unpadded prompt at a time, its own KV cache never reused, no graphs
        assert prefix is None, "a propagated prefill is not resumed from a prefix"
        return_kv, graphs = False, None
    if (config.local_attention or config.propagate_layer) and len(prompts) > 1:  # unpadded prompts: one by one
        runs = [score_prompts(model, [prompt], config, return_kv=return_kv, graphs=graphs) for prompt in prompts]
        kv_runs = [kv for _, kvs in runs if kvs is not None for kv in kvs]
        return [scores for run, _ in runs for scores in run], kv_runs if return_kv else None
    storage = None
    if graphs is not None and len(prompts) == 1:
        storage = graphs.storage_for(len(prompts[0]) + config.look_ahead)
    batch = _prepare(model, prompts, prefix, prefix_len, config.look_ahead, storage)
    eos = _eos(model)  # before the prefill is queued: a copy from host memory waits for the GPU to finish
    recorder = QueryRecorder(window=config.observation_window, local_attention=config.local_attention)
    with record_function("specprefill.prefill"):
        if config.propagate_layer:
            logits = propagate(model, batch, recorder, config)
        else:
            logits = prefill(model, batch, recorder)
    valid = None
    with record_function("specprefill.look_ahead"):
        if storage is not None and graphs is not None:
            valid = graphs.look_ahead(logits, batch.lengths[0], recorder, config.look_ahead, eos)
        if valid is None:
            valid = look_ahead(model, batch, logits, recorder, config.look_ahead, eos)
    with record_function("specprefill.reduce_scores"):
        scores = reduce_scores(batch, recorder, valid, config.pool_kernel).cpu()  # [B, S]
    results = [scores[row, batch.width - n :] for row, n in enumerate(batch.lengths)]
    kvs = _prompt_kvs(batch, prompts, copy=storage is not None) if return_kv else None
    return results, kvs


def _eos(model: PreTrainedModel) -> torch.Tensor:
    return torch.tensor(eos_token_ids(model), dtype=torch.long, device=model.device)


def prefill(model: PreTrainedModel, batch: ScoringBatch, recorder: QueryRecorder) -> torch.Tensor:
    """The prompt into the KV cache, recording the last prompt token's queries; its logits [B, V]."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        **with_cache(model, batch.cache),
        use_cache=True,
        logits_to_keep=1,
        specprefill_recorder=recorder,
    )
    logits: torch.Tensor = out.logits
    return logits[:, -1]


def propagate(
    model: PreTrainedModel, batch: ScoringBatch, recorder: QueryRecorder, config: ScoringConfig
) -> torch.Tensor:
    """``prefill`` whose layers from ``config.propagate_layer`` on read only the tokens the layers below rank
    highest by the scoring rule itself (``draft_worker.propagation``); its logits [1, V]."""
    layer = config.propagate_layer
    if layer >= model.config.num_hidden_layers:  # nothing above it: a plain prefill
        return prefill(model, batch, recorder)

    def choose() -> torch.Tensor:
        last_token_only = batch.input_ids.new_ones(1, 1, dtype=torch.bool)  # with the window, before the look-ahead
        ranks = reduce_scores(batch, recorder, last_token_only, config.pool_kernel, layer)
        return chosen_tokens(ranks[0], config.propagate_rate, config.observation_window)

    logits, batch.propagated = propagated_prefill(
        model,
        batch.input_ids,
        batch.position_ids,
        batch.cache,
        layer,
        choose,
        specprefill_recorder=recorder,
    )
    batch.propagate_layer = layer
    return logits


def look_ahead(
    model: PreTrainedModel,
    batch: ScoringBatch,
    logits: torch.Tensor,
    recorder: QueryRecorder,
    steps: int,
    eos: torch.Tensor,
) -> torch.Tensor:
    """``steps - 1`` greedy draft tokens, recording each one's queries. Returns which queries count [B, Q]:
    a row's queries stop once it generated ``eos`` (the EOS token's own query included)."""
    device = batch.input_ids.device
    n_rows = len(batch.lengths)
    valid = torch.ones(n_rows, steps, dtype=torch.bool, device=device)  # [B, Q]
    # right after each prompt, from tensors already on the device (a copy from host memory would wait for the GPU)
    if batch.position_ids is not None:
        position = batch.position_ids[:, -1:] + 1  # [B, 1]
    else:
        position = torch.full((n_rows, 1), batch.width, dtype=torch.long, device=device)
    for step in range(1, steps):
        token = logits.argmax(-1, keepdim=True)  # [B, 1]
        valid[:, step] = valid[:, step - 1] & ~torch.isin(token[:, 0], eos)
        if batch.attention_mask is not None:
            batch.attention_mask = torch.cat([batch.attention_mask, batch.attention_mask.new_ones(n_rows, 1)], -1)
        out = model(
            input_ids=token,
            attention_mask=batch.attention_mask,
            position_ids=position,
            **with_cache(model, batch.cache),
            use_cache=True,
            logits_to_keep=1,
            specprefill_recorder=recorder,
        )
        logits = out.logits[:, -1]
        position = position + 1
    return valid


def reduce_scores(
    batch: ScoringBatch, recorder: QueryRecorder, valid: torch.Tensor, pool_kernel: int, layers: int | None = None
) -> torch.Tensor:
    """Attention of the recorded queries over the prompt keys, pooled, max over layers × heads, mean over the
    valid queries: [B, S]. Queries recorded before the last prompt token's (an observation window) see only the
    keys up to their own, and count only on rows whose prompt reaches back to them (rows are left-padded).
    ``layers``: the first that many layers only. A layer that read only the propagated tokens scores those (the
    rest 0 there, as pooling's zero padding)."""
    key_pad = None
    if batch.attention_mask is not None:
        key_pad = batch.attention_mask[:, None, None, : batch.width] == 0  # [B, 1, 1, S]
    extra = recorder.layer_queries(0).shape[2] - valid.shape[1]  # window queries before the last prompt token's
    future, weights = _window(batch, extra, valid.float()) if extra else (None, valid.float())  # weights: [B, Q]
    scores: torch.Tensor | None = None
    for layer_idx, layer_cache in enumerate(attention_layers(batch.cache)[:layers]):
        index = batch.propagated if layer_idx >= batch.propagate_layer else None  # the keys' tokens, if not all
        width = batch.width if index is None else index.shape[0]
        keys = keys_values(layer_cache)[0][:, :, :width, :]  # [B, Hkv, S or S', D]
        queries = recorder.layer_queries(layer_idx)  # [B, H, W - 1 + Q, D]
        pooled = _layer_attention(
            queries, keys, recorder.scaling[layer_idx], key_pad, pool_kernel, future, index, batch.width
        )
        layer_max = pooled.amax(dim=1)  # [B, Q, S]
        scores = layer_max if scores is None else torch.maximum(scores, layer_max)
    assert scores is not None  # a model has layers
    return (scores * weights[:, :, None]).sum(1) / weights.sum(1, keepdim=True)


def _window(batch: ScoringBatch, extra: int, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``extra`` window queries before the last prompt token's: which keys each may not see ([W - 1 + Q, S]:
    those after it; none for the rest), and the weights with theirs first (0 where a row's prompt is shorter)."""
    device, width = weights.device, batch.width
    positions = torch.arange(width - 1 - extra, width - 1, device=device)  # the window queries' places
    keys = torch.arange(width, device=device)
    future = torch.zeros(extra + weights.shape[1], width, dtype=torch.bool, device=device)
    future[:extra] = keys[None, :] > positions[:, None]
    lengths = torch.tensor(batch.lengths, device=device)
    inside = positions[None, :] >= (width - lengths)[:, None]  # [B, W - 1]
    return future, torch.cat([inside.float(), weights], dim=1)


def _prepare(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    prefix: PromptKV | None,
    prefix_len: int,
    look_ahead: int,
    storage: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> ScoringBatch:
    """The batch's inputs, and a KV cache with room for the prompts and the look-ahead tokens, so that no
    forward copies the cache (``common.kv_cache``; in ``storage`` when given)."""
    device = model.device
    lengths = [len(p) for p in prompts]
    if prefix is not None:
        assert len(prompts) == 1 and 0 < prefix_len < lengths[0]
        cache = append_cache(
            model.config,
            lengths[0] + look_ahead,
            storage=storage,
            layers=[(k[:, :, :prefix_len], v[:, :, :prefix_len]) for k, v in prefix.layers],
        )
        return ScoringBatch(
            lengths,
            lengths[0],
            torch.tensor([prompts[0][prefix_len:]], device=device),
            torch.arange(prefix_len, lengths[0], device=device)[None],
            None,
            cache,
        )
    width = max(lengths)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
    cache = append_cache(model.config, width + look_ahead, storage=storage)
    if min(lengths) == width:
        return ScoringBatch(lengths, width, input_ids.to(device), None, None, cache)
    mask = (torch.arange(width) >= torch.tensor([width - n for n in lengths])[:, None]).long()
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ScoringBatch(lengths, width, input_ids.to(device), position_ids.to(device), mask.to(device), cache)


def _prompt_kvs(batch: ScoringBatch, prompts: Sequence[Sequence[int]], copy: bool = False) -> list[PromptKV]:
    """Each row's prompt entries, without padding or look-ahead; rows of a batch are copied out of it, and
    so is a cache in storage that the next prompt overwrites (``copy``)."""
    kvs = []
    for row, prompt in enumerate(prompts):
        start = batch.width - len(prompt)
        layers = []
        for layer in attention_layers(batch.cache):
            keys, values = keys_values(layer)
            k = keys[row : row + 1, :, start : batch.width]
            v = values[row : row + 1, :, start : batch.width]
            if len(prompts) > 1 or copy:
                k, v = k.clone(), v.clone()
            layers.append((k, v))
        kvs.append(PromptKV(torch.tensor(list(prompt), dtype=torch.long), layers))
    return kvs


def _layer_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    key_pad: torch.Tensor | None,
    pool_kernel: int,
    future: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    prompt_width: int = 0,
) -> torch.Tensor:
    """Softmax over the prompt keys, pooled along the sequence.

    queries: [B, H, Q, D]; keys: [B, Hkv, S, D]; ``future``: [Q, S], keys a query may not see; returns
    [B, H, Q, S]. GQA: query head h reads kv head h // (H / Hkv), as ``repeat_kv`` does; grouping the queries
    avoids materialising repeated keys. With ``index`` [S'] the keys are those prompt tokens of ``prompt_width``
    (keys: [B, Hkv, S', D]), and the others get probability 0 before pooling.
    """
    batch, heads, n_queries, dim = queries.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    if index is not None and future is not None:
        future = future[:, index]
    grouped = queries.reshape(batch, kv_heads, (heads // kv_heads) * n_queries, dim)
    logits = float_logits(grouped, keys) * scaling  # [B, Hkv, G*Q, S]
    if key_pad is not None:
        logits = logits.masked_fill(key_pad, float("-inf"))
    if future is not None:  # grouped rows are (head in group, query): g * Q + q
        logits = logits.masked_fill(future.repeat(heads // kv_heads, 1), float("-inf"))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if future is not None:  # a window query on a row's padding sees no key: its zero weight must not meet a NaN
        probs = probs.nan_to_num(0.0)
    probs = probs.reshape(batch, heads * n_queries, width)
    if index is not None:
        spread = probs.new_zeros(batch, heads * n_queries, prompt_width)
        probs, width = spread.index_copy_(2, index, probs), prompt_width
    if pool_kernel > 1:
        probs = F.avg_pool1d(probs, kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)
    return probs.reshape(batch, heads, n_queries, width)

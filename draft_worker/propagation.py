"""Token-selective propagation: the draft's upper layers read only the tokens its lower layers chose.

The draft's prefill costs about half the target's on a small same-family pair (a 0.5B before a 1.5B), so at
keep 0.1 the draft is most of the time to the first token. FastKV (Jo et al., 2025) lets only the tokens that a
middle layer's attention ranks highest go on to the layers above it. Here the draft runs its first ``layer``
decoder layers over the whole prompt, ranks every token with the scorer's own rule over those layers (the
scored queries of the observation window, pooled, max over layers and heads), and only the top ``rate`` of the
prompt (with the first tokens, on which attention sinks, and the window itself) goes on, at its original
positions, through the rest. The upper layers' KV cache holds those tokens alone; the look-ahead reads every
layer's cache as it is. Those layers' linear work shrinks with ``rate``, their attention with its square.

A forward here is the decoder's own loop, written out (embeddings, rotary, layers, final norm, head) so that the
sequence can shrink between two layers: the Llama family's shape (``model.model.embed_tokens``, ``layers``,
``rotary_emb``, ``norm``), one prompt at a time, with no padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from common.attention import ATTENTION_SINKS
from common.models import with_cache
from common.selection import ConfigError


def check_propagation(model: PreTrainedModel) -> None:
    """Raises ``ConfigError`` for a model whose decoder is not written as the loop below expects."""
    decoder = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "rotary_emb", "norm")
    if decoder is None or not all(hasattr(decoder, name) for name in needed) or not hasattr(model, "lm_head"):
        raise ConfigError(
            f"--propagate-layer needs a Llama-shaped draft (model.model.embed_tokens, layers, rotary_emb, norm); "
            f"{type(model).__name__} is not: leave --propagate-layer at 0"
        )
    if (
        getattr(model.config, "final_logit_softcapping", None)
        or getattr(model.config, "sliding_window", None)
        and any(kind != "full_attention" for kind in getattr(model.config, "layer_types", None) or ())
    ):
        raise ConfigError("--propagate-layer needs a draft with full attention in every layer and plain logits")


def chosen_tokens(scores: torch.Tensor, rate: float, window: int) -> torch.Tensor:
    """The prompt tokens that go on: the top ``rate`` of ``scores`` [S], the first ``ATTENTION_SINKS`` and the last
    ``window`` (the scored queries); sorted original indices [S'], int64."""
    width = scores.shape[-1]
    top = scores.topk(min(width, math.ceil(rate * width))).indices
    sure = torch.cat(
        [
            torch.arange(min(ATTENTION_SINKS, width), device=scores.device),
            torch.arange(max(0, width - window), width, device=scores.device),
        ]
    )
    chosen: torch.Tensor = torch.unique(torch.cat([top, sure]))  # sorted
    return chosen


@torch.inference_mode()
def propagated_prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    cache: Cache,
    layer: int,
    choose: Callable[[], torch.Tensor],
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt into ``cache``: every token through the first ``layer`` decoder layers, then only the tokens
    ``choose()`` returns (sorted indices into the prompt, called once the first ``layer`` layers' keys are in the
    cache) through the rest. input_ids: [1, S]; returns the last token's logits [1, V] and the chosen indices.
    ``kwargs`` reach every attention call (the query recorder)."""
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids)  # [1, S, E]
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    rotary = decoder.rotary_emb(hidden, position_ids)  # (cos, sin): [1, S, D]
    index = torch.arange(input_ids.shape[1], device=input_ids.device)
    for number, decoder_layer in enumerate(decoder.layers[: model.config.num_hidden_layers]):
        if number == layer:
            index = choose().to(input_ids.device)
            hidden, position_ids = hidden[:, index], position_ids[:, index]
            rotary = (rotary[0][:, index], rotary[1][:, index])
        hidden = decoder_layer(
            hidden,
            attention_mask=None,  # one unpadded prompt: causal by index, which the chosen tokens keep
            position_ids=position_ids,
            **with_cache(decoder_layer, cache),
            use_cache=True,
            position_embeddings=rotary,
            **kwargs,
        )
    logits: torch.Tensor = model.lm_head(decoder.norm(hidden[:, -1:]))
    return logits[:, -1], index

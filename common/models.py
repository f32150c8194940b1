"""Loading models and tokenizers through the ordinary transformers path (a local folder or a hub id), and
telling whether two tokenizers are one."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import time
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from common.attention import avoid_cudnn_sdpa, use_gqa_sdpa

# a model folder with a config, a tokenizer and this file instead of weights: random weights are made at load, from
# the file's seed, on the device (a 32B-parameter shape is made on a GPU in seconds; written out it would be 64 GB)
RANDOM_WEIGHTS = "random-weights.json"

log = logging.getLogger(__name__)


class TokenizerMismatchError(ValueError):
    """The draft and target models do not share one tokenizer, so draft token indices mean nothing to the target."""


def with_cache(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The KV cache as a forward's keyword: ``cache`` from transformers 5.24 on (``past_key_values`` is deprecated
    there, and removed in 5.40), ``past_key_values`` before."""
    return {_cache_keyword(cast(Any, type(model))): cache}


@functools.cache
def _cache_keyword(model_class: Any) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None or dtype == "auto":
        return "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16") from None


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype ``auto`` computes in: the checkpoint's own, except half precision on a CPU where a linear layer in
    it is slower than in float32 (no bfloat16 or float16 dot products: PyTorch falls back to a slow loop), where
    float32. Decided by timing the kind of call the models make (``_half_is_fast``), not by PyTorch's feature
    flags, which say what can run, not how fast: SmolLM2-135M's 2,000-token prefill on 2 AVX2 cores of an AMD EPYC
    took 37 s in bfloat16 and 8 s in float32; on 2 Xeon cores with AMX a 256x512 by 512x512 linear takes 0.08 ms
    in bfloat16 and 0.43 ms in float32."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return dtype
    return dtype if _half_is_fast(dtype) else torch.float32


@functools.cache
def _half_is_fast(dtype: torch.dtype, rows: int = 256, width: int = 512) -> bool:
    """Whether a linear layer in ``dtype`` on this CPU runs about as fast as in float32 or faster (within 1.25x: half
    the memory is worth a little time; the slow loop is 100x): the best of three runs of each after a warm-up,
    about a millisecond in float32."""
    seconds = {}
    for kind in (torch.float32, dtype):
        x, w = torch.randn(rows, width, dtype=kind), torch.randn(width, width, dtype=kind)
        torch.nn.functional.linear(x, w)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            runs.append(time.perf_counter() - start)
        seconds[kind] = min(runs)
    fast = seconds[dtype] <= 1.25 * seconds[torch.float32]
    log.info(
        "%s linear %.2f ms, float32 %.2f ms on this CPU: %s",
        dtype,
        seconds[dtype] * 1e3,
        seconds[torch.float32] * 1e3,
        "kept" if fast else "computing in float32",
    )
    return fast


def load_tokenizer(path_or_id: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path_or_id))


def load_causal_lm(
    path_or_id: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = "auto",
    attn_implementation: str = "sdpa",
    layers: int | None = None,
) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode on ``device`` with a fused attention kernel
    (``sdpa`` is ``common.attention``'s: grouped-query attention without copies of the KV cache). A folder with
    ``RANDOM_WEIGHTS`` gets random weights made on ``device``, for timing only. ``layers``: only the first that
    many decoder layers, then the model's own final norm and head (``first_layers``)."""
    random_weights = Path(path_or_id) / RANDOM_WEIGHTS
    model: Any
    if random_weights.is_file():
        model = _random_model(random_weights, device or default_device(), dtype, attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path_or_id), dtype=resolve_dtype(dtype), attn_implementation=attn_implementation
        )
    if layers is not None:
        first_layers(model, layers)
    use_gqa_sdpa(model)
    model = model.to(device or default_device()).eval()
    if resolve_dtype(dtype) == "auto" and (wanted := compute_dtype(model.dtype, model.device)) != model.dtype:
        log.info("%s: %s has no fast kernels on this CPU; computing in %s", path_or_id, model.dtype, wanted)
        model = model.to(wanted)
    if model.device.type == "cuda":
        avoid_cudnn_sdpa()
    loaded: PreTrainedModel = model
    return loaded


def first_layers(model: PreTrainedModel, layers: int) -> None:
    """Keeps the model's first ``layers`` decoder layers, followed by its final norm and head: a draft cut from a
    model's own layers (a self-draft, for a target with no smaller sibling). Raises ``ValueError`` outside
    1..the model's layer count."""
    check_layers(model.config.num_hidden_layers, layers)
    decoder = model.get_decoder()
    decoder.layers = decoder.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]


def check_layers(total: int, layers: int | None, name: str = "the draft model") -> None:
    if layers is not None and not 1 <= layers <= total:
        raise ValueError(
            f"--draft-layers {layers}: {name} has {total} decoder layers; use 1 to {total} "
            f"(or leave it out for all of them)"
        )


def decoder_layers(path_or_id: str | Path) -> int:
    """The model's decoder layer count, from its config alone."""
    return int(AutoConfig.from_pretrained(str(path_or_id)).num_hidden_layers)


def _random_model(
    spec_file: Path, device: str | torch.device, dtype: str | torch.dtype | None, attn_implementation: str
) -> PreTrainedModel:
    spec = json.loads(spec_file.read_text())  # {"seed": int, "dtype": "bfloat16"}
    resolved = resolve_dtype(dtype)
    config = AutoConfig.from_pretrained(spec_file.parent)
    torch.manual_seed(spec["seed"])
    with torch.device(device):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(
            config,
            dtype=resolve_dtype(spec["dtype"]) if resolved == "auto" else resolved,
            attn_implementation=attn_implementation,
        )
    return model


def check_same_tokenizer(draft: PreTrainedTokenizerBase, target: PreTrainedTokenizerBase) -> None:
    """Raises ``TokenizerMismatchError`` naming the first difference found."""
    if len(draft) != len(target):
        raise TokenizerMismatchError(
            f"the draft tokenizer has {len(draft)} tokens and the target's {len(target)}: "
            "SpecPrefill needs a draft from the target's model family (same tokenizer)"
        )
    draft_vocab, target_vocab = draft.get_vocab(), target.get_vocab()
    if draft_vocab != target_vocab:
        differing = (
            sorted(t for t in draft_vocab.keys() ^ target_vocab.keys())[:5]
            or [t for t, i in draft_vocab.items() if target_vocab.get(t) != i][:5]
        )
        raise TokenizerMismatchError(
            f"the draft and target vocabularies differ (for example {differing!r}): "
            "SpecPrefill needs a draft from the target's model family (same tokenizer)"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(draft, attr) != getattr(target, attr):
            raise TokenizerMismatchError(
                f"draft and target disagree on {attr}: {getattr(draft, attr)} vs {getattr(target, attr)}"
            )


def eos_token_ids(model: PreTrainedModel) -> list[int]:
    """The model's end-of-sequence IDs, from its generation config, else its config."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the vocabulary: equal for tokenizers that map every token to the same ID."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":"))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]

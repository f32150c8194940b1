"""The draft worker: the public object that scores prompts (``common.selection`` decides what is kept)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from common.models import load_causal_lm, load_tokenizer
from draft_worker.capture import enable_query_capture
from draft_worker.config import ScoringConfig
from draft_worker.graphs import LookAheadGraphs
from draft_worker.prefix_cache import PrefixKVCache
from draft_worker.propagation import check_propagation
from draft_worker.scorer import PromptKV, score_prompts


class PromptTooLongError(ValueError):
    """The prompt is longer than the draft model's position range."""


class DraftWorker:
    """Scores prompts with a draft model.

    Forwards are serialised by a lock: callers may use it from several threads. On CUDA the look-ahead
    steps replay CUDA graphs (``cuda_graphs=False``: plain forwards).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        config: ScoringConfig | None = None,
        name: str = "draft",
        prefix_cache_bytes: int = 1 << 30,
        cuda_graphs: bool = True,
    ) -> None:
        enable_query_capture(model)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or ScoringConfig()
        self.name = name
        if self.config.propagate_layer:
            check_propagation(model)
            prefix_cache_bytes = 0  # a propagated prompt's upper layers hold the tokens its own window chose
        window = self.config.observation_window
        self.prefix_cache = PrefixKVCache(prefix_cache_bytes, recompute=window) if prefix_cache_bytes > 0 else None
        self.identity = model_identity(model, name)
        self.graphs = LookAheadGraphs(model) if cuda_graphs and model.device.type == "cuda" else None
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        config: ScoringConfig | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = "auto",
        prefix_cache_bytes: int = 1 << 30,
        cuda_graphs: bool = True,
        layers: int | None = None,
    ) -> DraftWorker:
        """``layers``: only the model's first that many decoder layers (``common.models.first_layers``)."""
        model = load_causal_lm(path_or_id, device=device, dtype=dtype, layers=layers)
        return cls(
            model,
            load_tokenizer(path_or_id),
            config,
            name=str(path_or_id),
            prefix_cache_bytes=prefix_cache_bytes,
            cuda_graphs=cuda_graphs,
        )

    @property
    def max_prompt_tokens(self) -> int:
        # the look-ahead tokens need positions too
        return int(self.model.config.max_position_embeddings) - self.config.look_ahead

    def validate(self, prompt: Sequence[int]) -> None:
        """Raises ``ValueError`` (``PromptTooLongError``) for a prompt the draft cannot score."""
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("cannot score an empty prompt")
        if len(prompt) > self.max_prompt_tokens:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens; the draft model scores at most {self.max_prompt_tokens}"
            )
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"token IDs must be in [0, {vocab})")

    def score_many(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Token scores for several prompts, in one batched draft run (prefix-cache hits run alone)."""
        for prompt in prompts:
            self.validate(prompt)
        with self._lock:
            return self._score_locked(prompts)

    def _score_locked(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Prompts extending a cached one continue from its KV; the others share one batched run."""
        results: list[torch.Tensor | None] = [None] * len(prompts)
        fresh = []
        for index, prompt in enumerate(prompts):
            found = self.prefix_cache.lookup(prompt) if self.prefix_cache is not None else None
            if found is None:
                fresh.append(index)
                continue
            entry, reuse = found
            (scores,), kvs = score_prompts(
                self.model,
                [prompt],
                self.config,
                prefix=entry,
                prefix_len=reuse,
                return_kv=self.prefix_cache is not None,
                graphs=self.graphs,
            )
            results[index] = scores
            self._remember(kvs)
        if fresh:
            rows, kvs = score_prompts(
                self.model,
                [prompts[i] for i in fresh],
                self.config,
                return_kv=self.prefix_cache is not None,
                graphs=self.graphs,
            )
            for index, row in zip(fresh, rows):
                results[index] = row
            self._remember(kvs)
        return [r for r in results if r is not None]  # every prompt's, in order

    def _remember(self, kvs: list[PromptKV] | None) -> None:
        if self.prefix_cache is not None and kvs:
            for kv in kvs:
                self.prefix_cache.store(kv)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.score_many([token_ids])[0]


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

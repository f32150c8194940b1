"""The draft worker: the public object that scores prompts and selects the tokens to keep."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draft_worker.config import ScoringConfig, validate_keep_rate
from draft_worker.loader import load_causal_lm, load_tokenizer
from draft_worker.prefix_cache import PrefixKVCache
from draft_worker.scorer import enable_query_capture, model_identity, score_prompts
from draft_worker.selector import protected_mask, select_chunks


class PromptTooLongError(ValueError):
    """The prompt is longer than the draft model's position range."""


@dataclass(slots=True)
class Selection:
    scores: torch.Tensor  # [S] float32
    kept_indices: list[int]  # sorted; also the kept tokens' position IDs

    @property
    def original_tokens(self) -> int:
        return self.scores.numel()

    @property
    def kept_tokens(self) -> int:
        return len(self.kept_indices)


class DraftWorker:
    """Scores prompts with a draft model and selects kept tokens.

    Forwards are serialised by a lock: callers may use it from several threads.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        config: ScoringConfig | None = None,
        name: str = "draft",
        prefix_cache_bytes: int = 1 << 30,
    ) -> None:
        enable_query_capture(model)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or ScoringConfig()
        self.name = name
        self.prefix_cache = PrefixKVCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.identity = model_identity(model, name)
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
    ) -> DraftWorker:
        model = load_causal_lm(path_or_id, device=device, dtype=dtype)
        return cls(model, load_tokenizer(path_or_id), config, name=str(path_or_id),
                   prefix_cache_bytes=prefix_cache_bytes)

    @property
    def max_prompt_tokens(self) -> int:
        # the look-ahead tokens need positions too
        return self.model.config.max_position_embeddings - self.config.look_ahead

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
            (scores,), kvs = score_prompts(self.model, [prompt], self.config, prefix=entry, prefix_len=reuse,
                                           return_kv=self.prefix_cache is not None)
            results[index] = scores
            self._remember(kvs)
        if fresh:
            scores, kvs = score_prompts(self.model, [prompts[i] for i in fresh], self.config,
                                        return_kv=self.prefix_cache is not None)
            for index, row in zip(fresh, scores):
                results[index] = row
            self._remember(kvs)
        return results

    def _remember(self, kvs) -> None:
        if self.prefix_cache is not None and kvs:
            for kv in kvs:
                self.prefix_cache.store(kv)

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.score_many([token_ids])[0]

    def select(
        self, scores: torch.Tensor, keep_rate: float, extra_protected: Sequence[int] | None = None
    ) -> Selection:
        """Kept indices for ``keep_rate``, honouring the configured protected ends and ``extra_protected``."""
        keep_rate = validate_keep_rate(keep_rate)
        extra = torch.as_tensor(list(extra_protected), dtype=torch.long) if extra_protected else None
        protected = protected_mask(scores.numel(), self.config.protect_first, self.config.protect_last, extra)
        kept = select_chunks(scores, keep_rate, self.config.chunk_size, protected)
        return Selection(scores=scores, kept_indices=kept.tolist())

    def score_and_select(self, token_ids: Sequence[int], keep_rate: float) -> Selection:
        return self.select(self.score(token_ids), keep_rate)

"""Scores without a model: the baselines SpecPrefill is measured against.

``--draft-model baseline:random|head|tail`` serves one in place of a draft, so an eval can send the same
requests through the same gateway, rule (``select_tokens``: chunks, budget, protected tokens) and engine, and
only the scores differ: random chunks, the prompt's head (what truncating the end keeps), or its tail (the
most recent context, as a sliding window keeps).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import torch

from draft_worker.config import ScoringConfig

BASELINES = ("random", "head", "tail")
PREFIX = "baseline:"


def baseline_scores(kind: str, length: int, rng: random.Random) -> torch.Tensor:
    """[length] scores under which ``select_tokens`` keeps random chunks, the first ones or the last ones."""
    if kind == "random":
        return torch.tensor([rng.random() for _ in range(length)])
    if kind == "head":
        return torch.linspace(1.0, 0.0, length)
    if kind == "tail":
        return torch.linspace(0.0, 1.0, length)
    raise ValueError(f"unknown baseline {kind!r}; choose from {', '.join(BASELINES)}")


def baseline_kind(name: str | None) -> str | None:
    """``random`` for ``baseline:random``; None for a model's path or ID."""
    if name is None or not name.startswith(PREFIX):
        return None
    kind = name.removeprefix(PREFIX)
    if kind not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(PREFIX + b for b in BASELINES)}")
    return kind


class BaselineScorer:
    """A draft worker's interface (``score``, ``identity``, ``config``) with baseline scores. ``random`` is seeded
    by the prompt's tokens, so a prompt always keeps the same chunks."""

    tokenizer = None
    prefix_cache = None
    max_prompt_tokens = 1 << 31

    def __init__(self, kind: str, config: ScoringConfig | None = None) -> None:
        baseline_scores(kind, 1, random.Random(0))  # a clear error for an unknown kind
        self.kind = kind
        self.config = config or ScoringConfig()
        self.identity = PREFIX + kind

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        seed = hashlib.sha256(torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).digest()
        return baseline_scores(self.kind, len(token_ids), random.Random(seed))

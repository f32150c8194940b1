"""The arithmetic of a SpecPrefill request: the multiply-adds of a draft's read of a whole prompt and of the
target's prefill of what it keeps, against the target's prefill of the whole prompt (``lab/benchmarks/flop_share.py``
prints them). Every linear layer's, and causal attention's (the scores and the weighted values over half the
square); from a model's ``config.json`` or a named shape. Norms, activations and RoPE are left out (a few FLOPs a
hidden unit, against thousands in the linear maps)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.cache_folder import default_cache_dir


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape: what its FLOPs depend on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config["num_attention_heads"]
        return cls(
            layers=config["num_hidden_layers"],
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
        )

    def linear(self) -> int:
        """Multiply-adds of one token through every layer's linear maps (gated MLP), the head left out."""
        q = self.heads * self.head_dim
        kv = 2 * self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer

    def attention(self, queries: int, keys_before: int) -> int:
        """Multiply-adds of ``queries`` new tokens' causal attention after ``keys_before`` cached ones (scores and
        weighted values), every layer."""
        pairs = queries * keys_before + queries * (queries + 1) // 2
        return self.layers * self.heads * self.head_dim * 2 * pairs

    def prefill(self, tokens: int) -> int:
        """FLOPs of a prefill of ``tokens`` with the logits of its last token."""
        return 2 * (tokens * self.linear() + self.attention(tokens, 0) + self.hidden * self.vocab)

    def decode(self, steps: int, context: int) -> int:
        """FLOPs of ``steps`` greedy steps after ``context`` tokens, with their logits."""
        per_token = self.linear() + self.hidden * self.vocab
        return 2 * sum(per_token + self.attention(1, context + i) for i in range(steps))


# Shapes from the models' published configs (no weights): the paper's pairs and the README's GPU run.
SHAPES = {
    "llama-3.2-1b": Shape(16, 2048, 8192, 32, 8, 64, 128256),
    "llama-3.1-8b": Shape(32, 4096, 14336, 32, 8, 128, 128256),
    "llama-3.1-70b": Shape(80, 8192, 28672, 64, 8, 128, 128256),
    "llama-3.1-405b": Shape(126, 16384, 53248, 128, 8, 128, 128256),
}
REAL_PAIR = ("qwen2.5-coder-0.5b-instruct-v1", "qwen2.5-coder-1.5b-instruct-v1")


def shape(name: str) -> Shape:
    """A named shape, or the shape in a checkpoint folder's config (a path, or a folder under the cache)."""
    if name in SHAPES:
        return SHAPES[name]
    folder = Path(name) if Path(name).exists() else default_cache_dir() / name
    return Shape.of(json.loads((folder / "config.json").read_text()))


def shares(draft: Shape, target: Shape, tokens: int, keep: float, look_ahead: int, window: int) -> dict[str, float]:
    """The draft's and the kept tokens' FLOPs as shares of the target's whole prefill."""
    whole = target.prefill(tokens)
    scoring = 2 * draft.layers * draft.heads * draft.head_dim * (window + look_ahead) * tokens
    draft_flops = draft.prefill(tokens) + draft.decode(look_ahead - 1, tokens) + scoring
    kept = target.prefill(round(keep * tokens))
    return {"draft": draft_flops / whole, "kept": kept / whole, "total": (draft_flops + kept) / whole}

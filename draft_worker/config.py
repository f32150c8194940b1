"""Scoring configuration: the paper's defaults, validated once."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from common.selection import ConfigError, SelectionConfig, validate_keep_rate

__all__ = ["ConfigError", "ScoringConfig", "validate_keep_rate"]


@dataclass(slots=True, frozen=True)
class ScoringConfig(SelectionConfig):
    """How the draft scores prompt tokens, with the selection its scores are made for.

    Defaults follow SpecPrefill (Liu et al., 2025) and its official code: 8 look-ahead queries,
    average pooling with kernel 13, chunks of 32 tokens. Protection is this project's addition.
    """

    look_ahead: int = 8
    """Query positions whose attention is scored: the last prompt token plus ``look_ahead - 1`` greedy tokens."""
    pool_kernel: int = 13
    """Average-pooling kernel along the sequence (stride 1, padding ``kernel // 2``); 1 turns pooling off."""
    observation_window: int = 1
    """The prompt's last N tokens whose queries are scored, each over the keys up to its own (SnapKV's observation
    window, Li et al., 2024: a chat's question reads where its answer is); 1: the last token only, the paper."""

    local_attention: int = 0
    """The draft reads the prompt with local attention: each token sees the first 4 tokens (attention sinks) and
    the N before its block of 512, linear in the prompt's length where full attention is quadratic; the scored
    queries still see every key. 0: full attention, the paper's. This project's option (measured on the quality
    page), not the paper's."""

    propagate_layer: int = 0
    """From this decoder layer on, the draft reads only the prompt tokens its layers below rank highest by this
    scoring rule (FastKV's token-selective propagation, Jo et al., 2025), ``propagate_rate`` of them, at their
    positions: the upper layers' work shrinks with the rate. 0: every token through every layer, the paper's. This
    project's option (measured on the quality page), not the paper's."""
    propagate_rate: float = 0.3
    """The share of the prompt that goes on through the layers from ``propagate_layer`` (with the first tokens and
    the scored window's)."""

    def __post_init__(self) -> None:
        SelectionConfig.__post_init__(self)
        if self.propagate_layer < 0:
            raise ConfigError(
                f"propagate_layer must be >= 0 (0: every token through every layer), got {self.propagate_layer}"
            )
        if not (0.0 < self.propagate_rate <= 1.0):
            raise ConfigError(f"propagate_rate must be in (0, 1], got {self.propagate_rate}")
        if self.local_attention < 0:
            raise ConfigError(f"local_attention must be >= 0 (0: full attention), got {self.local_attention}")
        if self.look_ahead < 1:
            raise ConfigError(f"look_ahead must be >= 1, got {self.look_ahead}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ConfigError(f"pool_kernel must be a positive odd number, got {self.pool_kernel}")
        if self.observation_window < 1:
            raise ConfigError(f"observation_window must be >= 1, got {self.observation_window}")

    @property
    def score_params(self) -> tuple[int, ...]:
        """The parameters that change scores (not selection): part of every score-cache key (the paper's window
        leaves the keys as they were)."""
        window = (self.observation_window,) if self.observation_window > 1 else ()
        local = (f"local{self.local_attention}",) if self.local_attention else ()
        propagate = (f"propagate{self.propagate_layer}@{self.propagate_rate:g}",) if self.propagate_layer else ()
        return (self.look_ahead, self.pool_kernel, *window, *local, *propagate)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

"""Scoring configuration: the paper's defaults, validated once."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class ConfigError(ValueError):
    """A scoring option a user set is out of range."""


@dataclass(slots=True, frozen=True)
class ScoringConfig:
    """How the draft scores and selects prompt tokens.

    Defaults follow SpecPrefill (Liu et al., 2025) and its official code: 8 look-ahead queries,
    average pooling with kernel 13, chunks of 32 tokens. Protection is this project's addition.
    """

    look_ahead: int = 8
    """Query positions whose attention is scored: the last prompt token plus ``look_ahead - 1`` greedy tokens."""
    pool_kernel: int = 13
    """Average-pooling kernel along the sequence (stride 1, padding ``kernel // 2``); 1 turns pooling off."""
    chunk_size: int = 32
    """Tokens are kept in contiguous chunks of this size; 1 selects single tokens."""
    protect_first: int = 4
    """The first N prompt tokens are always kept (one by one, counted in the keep budget); 0 turns it off."""
    protect_last: int = 32
    """The last N prompt tokens are always kept (one by one, counted in the keep budget); 0 turns it off."""

    def __post_init__(self) -> None:
        if self.look_ahead < 1:
            raise ConfigError(f"look_ahead must be >= 1, got {self.look_ahead}")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ConfigError(f"pool_kernel must be a positive odd number, got {self.pool_kernel}")
        if self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.protect_first < 0 or self.protect_last < 0:
            raise ConfigError("protect_first and protect_last must be >= 0")

    @property
    def score_params(self) -> tuple[int, int]:
        """The parameters that change scores (not selection): part of every score-cache key."""
        return (self.look_ahead, self.pool_kernel)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def validate_keep_rate(keep_rate: float) -> float:
    """A keep rate is a finite number in (0, 1]."""
    if not (0.0 < keep_rate <= 1.0):  # also false for NaN
        raise ConfigError(f"keep rate must be a number in (0, 1], got {keep_rate!r}")
    return float(keep_rate)

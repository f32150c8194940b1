"""Per-request positions: read from the sampling parameters, checked, and expanded. No vLLM imports."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

KEY = "position_ids"


class PositionError(ValueError):
    """A request's position_ids are unusable; the message says what to change."""


def requested_positions(sampling_params: Any) -> list[int] | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    positions = extra.get(KEY)
    return None if positions is None else list(positions)


def check_positions(positions: Sequence[Any], n_prompt: int, max_positions: int, max_tokens: int | None) -> None:
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in positions):
        raise PositionError("vllm_xargs.position_ids must be a list of integers")
    if len(positions) != n_prompt:
        raise PositionError(
            f"vllm_xargs.position_ids has {len(positions)} entries for {n_prompt} prompt tokens; give one per token"
        )
    if not positions:
        raise PositionError("vllm_xargs.position_ids is empty")
    if positions[0] < 0:
        raise PositionError("vllm_xargs.position_ids must be non-negative")
    if any(b <= a for a, b in zip(positions, positions[1:])):
        raise PositionError("vllm_xargs.position_ids must be strictly increasing")
    if positions[-1] >= max_positions:
        raise PositionError(
            f"vllm_xargs.position_ids must be below the model's max_position_embeddings ({max_positions})"
        )
    room = max_positions - 1 - positions[-1]
    if max_tokens is not None and max_tokens > room:
        raise PositionError(
            f"the prompt ends at position {positions[-1]} and max_tokens is {max_tokens}, past the model's "
            f"{max_positions} positions; ask for at most {room} tokens"
        )


def expand(positions: Sequence[int] | None, n_tokens: int) -> tuple[list[int], int]:
    """Positions of ``n_tokens`` tokens (the prompt, plus earlier outputs after a preemption) and the
    delta that vLLM adds to a token's index to get its position from then on."""
    if positions is None:
        return list(range(n_tokens)), 0
    n_prompt = len(positions)
    assert n_tokens >= n_prompt, "fewer tokens than prompt positions"
    last = positions[-1]
    full = list(positions) + [last + 1 + i for i in range(n_tokens - n_prompt)]
    return full, last + 1 - n_prompt


def block_key(positions: Sequence[int] | None, start: int, end: int) -> str | None:
    """A block-hash extra key for tokens ``start..end-1`` when their positions are not the default ones."""
    if positions is None:
        return None
    full, _ = expand(positions, max(end, len(positions)))
    block = full[start:end]
    if block == list(range(start, end)):
        return None
    return hashlib.sha256(",".join(map(str, block)).encode()).hexdigest()[:32]

"""The swap: after vLLM rendered and tokenised a request, its prompt replaced by the kept tokens at their
positions. No vLLM imports. The gateway's reference engine has the same rule (``common/swap.py``); a test in
the project holds the two equal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KEPT_KEY = "kept_token_ids"
SWAP_PARAM = f"vllm_xargs.{KEPT_KEY}"


class SwapError(ValueError):
    """A swap vLLM cannot make; ``mismatch`` when the kept tokens are not the rendered prompt's."""

    def __init__(self, message: str, mismatch: bool = False) -> None:
        super().__init__(message)
        self.mismatch = mismatch


def requested_kept(sampling_params: Any) -> list[Any] | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    kept = extra.get(KEPT_KEY)
    return None if kept is None else list(kept)


def swap_prompt(rendered: Sequence[int], kept: Sequence[Any], positions: Sequence[Any] | None) -> list[int]:
    """The kept tokens, once checked against the rendered prompt at their positions."""
    if positions is None:
        raise SwapError("vllm_xargs.kept_token_ids needs vllm_xargs.position_ids, one per kept token")
    if not all(_is_int(t) for t in kept) or not all(_is_int(p) for p in positions):
        raise SwapError("kept_token_ids and position_ids must be lists of integers")
    if not kept or len(kept) != len(positions):
        raise SwapError(
            f"kept_token_ids has {len(kept)} entries and position_ids {len(positions)}; give one "
            "position per kept token, at least one"
        )
    if positions[0] < 0 or any(b <= a for a, b in zip(positions, positions[1:])):
        raise SwapError("position_ids must be non-negative and strictly increasing")
    n = len(rendered)
    for token, position in zip(kept, positions):
        if position >= n:
            raise SwapError(f"kept position {position} is past the rendered prompt's {n} tokens", mismatch=True)
        if rendered[position] != token:
            raise SwapError(
                f"kept token {token} at position {position} differs from the rendered prompt's token "
                f"{rendered[position]} there",
                mismatch=True,
            )
    if positions[-1] != n - 1:
        raise SwapError(
            f"the last kept position is {positions[-1]}, but the rendered prompt's last token is at {n - 1}",
            mismatch=True,
        )
    return list(kept)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""The swap: a prompt the backend rendered itself, replaced by the kept tokens at their positions.

The gateway sends the client's own body to the backend's own endpoint (chat, Responses, completions) plus
``vllm_xargs: {"kept_token_ids": [...], "position_ids": [...]}``. The backend renders and tokenises as usual;
this rule then checks that every kept token is the rendered prompt's token at its position and that the last
kept position is the rendered prompt's last token, and runs the kept tokens at those positions instead.
vLLM's plugin carries its own copy of this rule (it imports nothing of ours); a test holds them equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.errors import InvalidRequestError

KEPT_KEY = "kept_token_ids"
POSITIONS_KEY = "position_ids"
SWAP_PARAM = f"vllm_xargs.{KEPT_KEY}"
MISMATCH_CODE = "specprefill_swap_mismatch"


class SwapMismatchError(InvalidRequestError):
    """The kept tokens are not the rendered prompt's: the gateway's rendering differs from the backend's."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param=SWAP_PARAM, code=MISMATCH_CODE)


def requested_swap(xargs: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """The kept tokens and their positions, when ``vllm_xargs`` asks for a swap."""
    if not xargs or xargs.get(KEPT_KEY) is None:
        return None
    kept, positions = xargs.get(KEPT_KEY), xargs.get(POSITIONS_KEY)
    if not isinstance(kept, list) or not isinstance(positions, list):
        raise InvalidRequestError(
            f"vllm_xargs.{KEPT_KEY} and vllm_xargs.{POSITIONS_KEY} must both be lists", param=SWAP_PARAM
        )
    return kept, positions


def swap_prompt(rendered: Sequence[int], kept: Sequence[Any], positions: Sequence[Any]) -> tuple[list[int], list[int]]:
    """``(kept, positions)`` once they are checked against the rendered prompt's tokens; a 400 otherwise."""
    if not all(_is_int(t) for t in kept) or not all(_is_int(p) for p in positions):
        raise InvalidRequestError("kept_token_ids and position_ids must be lists of integers", param=SWAP_PARAM)
    if not kept or len(kept) != len(positions):
        raise InvalidRequestError(
            f"kept_token_ids has {len(kept)} entries and position_ids {len(positions)}; give "
            "one position per kept token, at least one",
            param=SWAP_PARAM,
        )
    if positions[0] < 0 or any(b <= a for a, b in zip(positions, positions[1:])):
        raise InvalidRequestError(
            "position_ids must be non-negative and strictly increasing", param=f"vllm_xargs.{POSITIONS_KEY}"
        )
    n = len(rendered)
    for token, position in zip(kept, positions):
        if position >= n:
            raise SwapMismatchError(f"kept position {position} is past the rendered prompt's {n} tokens")
        if rendered[position] != token:
            raise SwapMismatchError(
                f"kept token {token} at position {position} differs from the rendered "
                f"prompt's token {rendered[position]} there"
            )
    if positions[-1] != n - 1:
        raise SwapMismatchError(
            f"the last kept position is {positions[-1]}, but the rendered prompt's last token is at {n - 1}"
        )
    return list(kept), list(positions)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

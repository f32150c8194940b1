"""Compression policy: which keep rate applies to a request, and when a request bypasses compression."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from common.errors import InvalidRequestError
from common.protocol import SpecPrefillOptions
from common.selection import validate_keep_rate

KEEP_RATE_HEADER = "x-keep-rate"
MODE_HEADER = "x-specprefill"


class Reason:
    """Why a request was bypassed (the ``x-specprefill-reason`` header and a metrics label)."""

    OFF = "off"
    KEEP_RATE_ONE = "keep_rate_one"
    SHORT_PROMPT = "short_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    DRAFT_ERROR = "draft_error"
    UNSCORED_CONTENT = "unscored_content"
    """Content parts the draft cannot read (images, audio): the request goes whole."""
    SWAP_MISMATCH = "swap_mismatch"
    """The backend rendered the request differently from the gateway, so the kept tokens were not its own."""
    CHEAPER_WHOLE = "cheaper_whole"
    """The cost model priced the whole prompt below any compression (short, mostly cached, or a slow draft)."""
    CACHED = "cached"
    """The engine holds nearly all of the prompt (``--whole-when-cached``): the target reads all of it, at the price
    of its new tokens."""

    @staticmethod
    def unsupported(feature: str) -> str:
        return f"unsupported_{feature}"


@dataclass(frozen=True, slots=True)
class RequestOptions:
    keep_rate: float
    enabled: bool


def parse_keep_rate(raw: str | float, param: str) -> float:
    """A decimal in (0, 1]; anything else is a 400 naming ``param``."""
    try:
        return validate_keep_rate(float(raw.strip() if isinstance(raw, str) else raw))
    except ValueError:
        raise InvalidRequestError(
            f"{param} must be a decimal in (0, 1], for example 0.3 (1 forwards the whole prompt); got {raw!r}",
            param=param,
        ) from None


def request_options(
    headers: Mapping[str, str], body_options: SpecPrefillOptions | None, default_keep_rate: float
) -> RequestOptions:
    """The header wins over the body extension, which wins over the server default."""
    mode = headers.get(MODE_HEADER)
    if mode is not None and mode.strip().lower() not in ("on", "off"):
        raise InvalidRequestError(f"{MODE_HEADER} must be 'on' or 'off', got {mode!r}", param=MODE_HEADER)
    enabled = mode is None or mode.strip().lower() == "on"
    raw = headers.get(KEEP_RATE_HEADER)
    if raw is not None:
        keep_rate = parse_keep_rate(raw, KEEP_RATE_HEADER)
    elif body_options is not None and body_options.keep_rate is not None:
        keep_rate = parse_keep_rate(body_options.keep_rate, "specprefill.keep_rate")
    else:
        keep_rate = default_keep_rate
    return RequestOptions(keep_rate=keep_rate, enabled=enabled)

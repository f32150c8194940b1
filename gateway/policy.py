"""Compression policy: which keep rate applies to a request, and when a request bypasses compression."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specprefill.chat_format import SpecPrefillOptions
from specprefill.openai_api import InvalidRequestError

KEEP_RATE_HEADER = "x-keep-rate"
MODE_HEADER = "x-specprefill"


class Reason:
    """Why a request was bypassed (the ``x-specprefill-reason`` header and a metrics label)."""

    OFF = "off"
    KEEP_RATE_ONE = "keep_rate_one"
    SHORT_PROMPT = "short_prompt"
    PROMPT_TOO_LONG = "prompt_too_long"
    DRAFT_ERROR = "draft_error"

    @staticmethod
    def unsupported(feature: str) -> str:
        return f"unsupported_{feature}"


@dataclass(frozen=True, slots=True)
class RequestOptions:
    keep_rate: float
    enabled: bool


def parse_keep_rate(raw: str, param: str) -> float:
    """A decimal in (0, 1]; anything else is a 400 naming ``param``."""
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not raw.strip() or not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise InvalidRequestError(
            f"{param} must be a decimal in (0, 1], for example 0.3 (1 forwards the whole prompt); got {raw!r}",
            param=param,
        )
    return value


def request_options(headers, body_options: SpecPrefillOptions | None, default_keep_rate: float) -> RequestOptions:
    """The header wins over the body extension, which wins over the server default."""
    mode = headers.get(MODE_HEADER)
    if mode is not None and mode.strip().lower() not in ("on", "off"):
        raise InvalidRequestError(f"{MODE_HEADER} must be 'on' or 'off', got {mode!r}", param=MODE_HEADER)
    enabled = mode is None or mode.strip().lower() == "on"
    raw = headers.get(KEEP_RATE_HEADER)
    if raw is not None:
        keep_rate = parse_keep_rate(raw, KEEP_RATE_HEADER)
    elif body_options is not None and body_options.keep_rate is not None:
        keep_rate = parse_keep_rate(repr(body_options.keep_rate), "specprefill.keep_rate")
    else:
        keep_rate = default_keep_rate
    return RequestOptions(keep_rate=keep_rate, enabled=enabled)

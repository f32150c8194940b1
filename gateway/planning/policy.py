"""Compression policy: which keep rate applies to a request, and when a request bypasses compression."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from common.errors import InvalidRequestError
from common.protocol import SpecPrefillOptions
from common.selection import AutoKeepRate, ConfigError, KeepRate, validate_keep_rate

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
    keep_rate: float  # the rate applied; for ``auto`` before the draft has run, its ceiling (what it may cost)
    enabled: bool
    auto: AutoKeepRate | None = None  # ``x-keep-rate: auto``: the draft's scores choose the rate

    def applied(self, keep_rate: float) -> RequestOptions:
        """These options at the rate ``auto`` chose."""
        return replace(self, keep_rate=keep_rate)


def parse_keep_rate(raw: str | float, param: str, auto: AutoKeepRate | None = None) -> KeepRate:
    """A decimal in (0, 1], or ``auto`` (given ``auto``: the server's rule); anything else is a 400 naming
    ``param``."""
    if auto is not None and isinstance(raw, str) and raw.strip().lower() == "auto":
        return auto
    try:
        return validate_keep_rate(float(raw.strip() if isinstance(raw, str) else raw))
    except ValueError:
        raise InvalidRequestError(
            f"{param} must be a decimal in (0, 1], for example 0.3 (1 forwards the whole prompt), or auto; got {raw!r}",
            param=param,
        ) from None


def _auto_rule(body_options: SpecPrefillOptions | None, server: AutoKeepRate) -> AutoKeepRate:
    """The server's auto rule with the body's own target and bounds, where it sets them (a 400 naming the one
    that is out of range)."""
    if body_options is None:
        return server
    fields = {
        "target": body_options.auto_target,
        "floor": body_options.auto_floor,
        "ceiling": body_options.auto_ceiling,
    }
    asked = {name: value for name, value in fields.items() if value is not None}
    if not asked:
        return server
    try:
        return replace(server, **asked)
    except ConfigError as exc:
        param = next((f"specprefill.auto_{name}" for name in asked if f"'s {name}" in str(exc)), "specprefill")
        raise InvalidRequestError(f"{param}: {exc}", param=param) from None


def request_options(
    headers: Mapping[str, str], body_options: SpecPrefillOptions | None, default_keep_rate: KeepRate
) -> RequestOptions:
    """The header wins over the body extension, which wins over the server default."""
    mode = headers.get(MODE_HEADER)
    if mode is not None and mode.strip().lower() not in ("on", "off"):
        raise InvalidRequestError(f"{MODE_HEADER} must be 'on' or 'off', got {mode!r}", param=MODE_HEADER)
    enabled = mode is None or mode.strip().lower() == "on"
    auto = _auto_rule(
        body_options, default_keep_rate if isinstance(default_keep_rate, AutoKeepRate) else AutoKeepRate()
    )
    raw = headers.get(KEEP_RATE_HEADER)
    keep_rate: KeepRate
    if raw is not None:
        keep_rate = parse_keep_rate(raw, KEEP_RATE_HEADER, auto)
    elif body_options is not None and body_options.keep_rate is not None:
        keep_rate = parse_keep_rate(body_options.keep_rate, "specprefill.keep_rate", auto)
    else:
        keep_rate = auto if isinstance(default_keep_rate, AutoKeepRate) else default_keep_rate
    if isinstance(keep_rate, AutoKeepRate):
        return RequestOptions(keep_rate=keep_rate.ceiling, enabled=enabled, auto=keep_rate)
    return RequestOptions(keep_rate=keep_rate, enabled=enabled)

"""The token-importance inspector: a prompt's scores and what the target reads of it at every keep rate.

One view, two homes: the gateway serves it at ``/specprefill/inspect`` (the page asks
``/v1/specprefill/inspect`` for the data), and ``specprefill score --html`` writes it as one file with the
data inlined. Either way the selections come from the one rule (the planner's dry run in the gateway,
``select_tokens`` in ``score``), for every keep rate on the slider's grid, so moving the slider never
runs the draft again nor selects anything in the browser: it only switches between selections made here.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import torch

KEEP_RATES = tuple(round(0.01 * i, 2) for i in range(1, 101))  # the slider's grid
PAGE_TITLE = "SpecPrefill inspector"


def runs(indices: Sequence[int]) -> list[list[int]]:
    """Sorted indices as ``[start, end)`` runs: ``[0, 1, 2, 7, 8]`` -> ``[[0, 3], [7, 9]]``."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def inspection(
    pieces: list[str],
    scores: torch.Tensor,
    protected: torch.Tensor | None,
    chunk_size: int,
    keep_rate: float,
    plans: dict[float, dict[str, Any]],
    **about: Any,
) -> dict[str, Any]:
    """The page's data. ``plans``: per keep rate of the grid, ``{"status", "reason", "plan", "kept": runs}``
    (what the target reads) and optionally ``"selected": runs`` (what the rule keeps where the target reads
    the whole prompt anyway); ``about``: counts and timings shown as they are (draft_ms, cache, ...)."""
    protected_runs = runs(protected.nonzero().squeeze(1).tolist()) if protected is not None else []
    return {
        "original_tokens": len(pieces),
        "chunk_size": chunk_size,
        "keep_rate": keep_rate,
        "tokens": pieces,
        "scores": [float(f"{s:.6g}") for s in scores.tolist()],  # six significant digits
        "protected": protected_runs,
        "keep_rates": [{"keep_rate": rate, **plan} for rate, plan in sorted(plans.items())],
        **about,
    }


def selections(select: Callable[[float], list[int]], chunk_for: Callable[[float], int]) -> dict[float, dict[str, Any]]:
    """The grid's plans from a selection rule alone (``specprefill score``: no planner, no bypasses); ``chunk_for``:
    the chunk size each rate's selection is cut in (``SelectionConfig.chunk_for``)."""
    plans = {}
    for rate in KEEP_RATES:
        kept = select(rate)
        plans[rate] = {
            "status": "compressed" if rate < 1 else "bypassed",
            "reason": None if rate < 1 else "keep_rate_one",
            "plan": "fresh" if rate < 1 else "whole",
            "kept": runs(kept),
            "chunk_size": chunk_for(rate),
        }
    return plans


def page(data: dict[str, Any] | None = None, *, api: str = "/v1/specprefill/inspect") -> str:
    """The page: with ``data``, self-contained (the selections inlined, no form); without, a form that posts
    to ``api``. No external script, style sheet or font: it works offline."""
    template = resources.files("gateway.entrypoints").joinpath("inspector.html").read_text(encoding="utf-8")
    # inside <script type="application/json"> only "</" could end the element early
    inlined = json.dumps(data, ensure_ascii=False).replace("</", "<\\/") if data is not None else "null"
    return (
        template.replace("__TITLE__", html.escape(PAGE_TITLE))
        .replace("__API__", html.escape(api, quote=True))
        .replace("__DATA__", inlined)
    )

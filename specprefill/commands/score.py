"""``specprefill score``: what the draft keeps of one prompt, by the same rule the gateway applies."""

from __future__ import annotations

import json
import sys
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import CliPositionalArg

from common.options import DeviceOptions
from common.selection import DEFAULT_KEEP_RATE, AutoKeepRate, KeepRate, validate_keep_rate
from draft_worker.settings import ScoringOptions

_AUTO = AutoKeepRate()  # the auto rule's default target and bounds

DIM_STRIKE, RESET = "\x1b[2;9m", "\x1b[0m"


class Score(DeviceOptions, ScoringOptions):
    """Score one prompt with a draft model and show what the target would read."""

    file: CliPositionalArg[str] = Field(description="a text file, or - for standard input")
    model: str = Field(description="draft model: a local folder or a hub id")
    keep_rate: float | Literal["auto"] = Field(
        DEFAULT_KEEP_RATE, description="fraction of chunks kept, in (0, 1], or auto (the gateway's rule: --auto-keep-*)"
    )
    auto_keep_target: float = Field(_AUTO.target, gt=0, le=1, description="auto: the share of the score mass kept")
    auto_keep_floor: float = Field(_AUTO.floor, gt=0, le=1, description="auto: the least keep rate")
    auto_keep_ceiling: float = Field(_AUTO.ceiling, gt=0, le=1, description="auto: the most")
    token_ids: bool = Field(False, description="read a JSON list of token IDs instead of text")
    json_output: bool = Field(
        False, validation_alias=AliasChoices("json", "json_output"), description="print the numbers as JSON"
    )
    html: str | None = Field(
        None,
        description="also write the inspector's view to this file: one self-contained "
        "HTML page, with a keep-rate slider over the same selections",
    )

    @field_validator("keep_rate", mode="before")
    @classmethod
    def _keep_rate(cls, value: float | str) -> float | str:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return validate_keep_rate(float(value))

    def rule(self) -> KeepRate:
        if self.keep_rate == "auto":
            return AutoKeepRate(self.auto_keep_target, self.auto_keep_floor, self.auto_keep_ceiling)
        return self.keep_rate

    def cli_cmd(self) -> None:
        raise SystemExit(run_score(self))


def run_score(options: Score) -> int:
    from common.selection import applied_keep_rate, select_tokens
    from draft_worker import DraftWorker

    try:
        raw = _read_input(options.file)
        token_ids = parse_token_ids(raw) if options.token_ids else None
        config = options.scoring_config()
        worker = DraftWorker.from_pretrained(
            options.model, config, device=options.device, dtype=options.dtype, layers=options.draft_layers
        )
        if token_ids is None:
            token_ids = worker.tokenizer(raw).input_ids  # as the gateway tokenizes a completion prompt
        scores = worker.score(token_ids)
    except (ValueError, OSError) as exc:
        print(f"specprefill score: error: {exc}", file=sys.stderr)
        return 2
    special = worker.tokenizer.all_special_ids
    try:
        rate = applied_keep_rate(options.rule(), token_ids, scores, config, special)
    except ValueError as exc:  # an auto rule's floor above its ceiling
        print(f"specprefill score: error: {exc}", file=sys.stderr)
        return 2
    kept = select_tokens(token_ids, scores, rate, config, special)
    if options.html:
        write_html(options.html, worker.tokenizer, token_ids, scores, config, special, rate, options.model)
    if options.json_output:
        print(
            json.dumps(
                {
                    "original_tokens": len(token_ids),
                    "kept_tokens": len(kept),
                    "kept_indices": kept,
                    "scores": [round(s, 8) for s in scores.tolist()],
                }
            )
        )
        return 0
    print(render_kept(worker.tokenizer, token_ids, kept, color=sys.stdout.isatty()))
    print(
        f"\nkept {len(kept)} of {len(token_ids)} tokens ({len(kept) / len(token_ids):.1%}; "
        f"keep rate {rate:g}{' (auto)' if options.keep_rate == 'auto' else ''}, "
        f"chunks of {config.chunk_for(len(token_ids), rate)})",
        file=sys.stderr,
    )
    return 0


def write_html(
    path: str, tokenizer, token_ids: list[int], scores, config, special: list[int], keep_rate: float, model: str
) -> None:
    """The inspector's page with this prompt's scores and selections inlined (``gateway.entrypoints.inspector``)."""
    from common.selection import always_kept, select_tokens
    from common.tokenize import token_pieces
    from gateway.entrypoints.inspector import inspection, page, selections

    plans = selections(
        lambda rate: select_tokens(token_ids, scores, rate, config, special),
        lambda rate: config.chunk_for(len(token_ids), rate),
    )
    data = inspection(
        token_pieces(tokenizer, token_ids),
        scores,
        always_kept(token_ids, config, special),
        config.chunk_for(len(token_ids), keep_rate),
        round(keep_rate, 2),
        plans,
        model=model,
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page(data))
    print(f"wrote {path}", file=sys.stderr)


def _read_input(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def parse_token_ids(text: str) -> list[int]:
    try:
        ids = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--token-ids expects a JSON list of integers: {exc}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("--token-ids expects a non-empty JSON list of integers")
    return ids


def render_kept(tokenizer, token_ids: list[int], kept: list[int], color: bool) -> str:
    """The prompt with every dropped span marked, so a user can read what the target will see."""
    kept_set = set(kept)
    pieces, span, span_kept = [], [], None
    for index, token in enumerate(token_ids):
        is_kept = index in kept_set
        if span and is_kept != span_kept:
            pieces.append((span_kept, span))
            span = []
        span_kept = is_kept
        span.append(token)
    if span:
        pieces.append((span_kept, span))
    out = []
    for is_kept, ids in pieces:
        text = tokenizer.decode(ids)
        if is_kept:
            out.append(text)
        elif color:
            out.append(f"{DIM_STRIKE}{text}{RESET}")
        else:
            out.append(f"[[-{len(ids)} dropped: {text}-]]")
    return "".join(out)

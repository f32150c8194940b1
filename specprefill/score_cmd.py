"""``specprefill score``: what the draft keeps of one prompt."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specprefill.cli import Score

DIM_STRIKE, RESET = "\x1b[2;9m", "\x1b[0m"


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
        text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
        if is_kept:
            out.append(text)
        elif color:
            out.append(f"{DIM_STRIKE}{text}{RESET}")
        else:
            out.append(f"[[-{len(ids)} dropped: {text}-]]")
    return "".join(out)


def run_score(options: Score) -> int:
    from draft_worker import DraftWorker

    try:
        raw = _read_input(options.file)
        token_ids = parse_token_ids(raw) if options.token_ids else None
        config = options.scoring_config()
        worker = DraftWorker.from_pretrained(options.model, config, device=options.device, dtype=options.dtype)
        if token_ids is None:
            token_ids = worker.tokenizer(raw).input_ids
        selection = worker.select(worker.score(token_ids), options.keep_rate)
    except (ValueError, OSError) as exc:
        print(f"specprefill score: error: {exc}", file=sys.stderr)
        return 2

    if options.json_output:
        print(
            json.dumps(
                {
                    "original_tokens": selection.original_tokens,
                    "kept_tokens": selection.kept_tokens,
                    "kept_indices": selection.kept_indices,
                    "scores": [round(s, 8) for s in selection.scores.tolist()],
                }
            )
        )
        return 0
    print(render_kept(worker.tokenizer, token_ids, selection.kept_indices, color=sys.stdout.isatty()))
    print(
        f"\nkept {selection.kept_tokens} of {selection.original_tokens} tokens "
        f"({selection.kept_tokens / selection.original_tokens:.1%}; keep rate {options.keep_rate}, "
        f"chunks of {config.chunk_size})",
        file=sys.stderr,
    )
    return 0

"""Backends without positions that take text (``--backend-kind text``): kept tokens decoded back into text.

Positions are lost, and re-tokenisation may split words differently; each dropped span becomes one mark,
so the model reads that text was left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from common.chat import RenderedChat
from common.protocol import ChatMessage

DROPPED_MARK = " … "


def kept_text(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], kept: Sequence[int]) -> str:
    """Kept tokens as text, each dropped span replaced by ``DROPPED_MARK``."""
    runs, run, last = [], [], None
    for index in kept:
        if last is not None and index != last + 1:
            runs.append(run)
            run = []
        run.append(token_ids[index])
        last = index
    runs.append(run)
    text = DROPPED_MARK.join(str(tokenizer.decode(r, skip_special_tokens=True)) for r in runs if r)
    if kept and kept[0] > 0:
        text = DROPPED_MARK.lstrip() + text
    return text


def kept_messages(
    tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], rendered: RenderedChat, kept: Sequence[int]
) -> list[dict[str, Any]]:
    """Each message's content cut to its kept tokens (the roles and the message list stay)."""
    kept_set = set(kept)
    out_messages = []
    for message, span in zip(messages, rendered.content_spans(messages)):
        out = message.model_dump(exclude_none=True)
        if span is not None:  # else the template changed the content beyond recognition: keep it whole
            inside = rendered.tokens_in(span)
            kept_inside = [i for i in inside if i in kept_set]
            if kept_inside != inside:
                out["content"] = kept_text(tokenizer, rendered.token_ids, kept_inside) if kept_inside else ""
        out_messages.append(out)
    return out_messages

"""The fewest tokens a prompt can take, from its characters alone: a prompt that cannot fit is refused before any
tokenizing.

A byte-level BPE or a SentencePiece tokenizer with byte fallback covers every character of its input with
tokens, and no token covers more characters than its vocabulary entry is long (a byte-level entry spells each
byte with one character; a decoded character takes one byte or more). So a text of N characters takes at least
N / L tokens, L the longest entry (added tokens included): counting only characters that are not whitespace keeps
the bound true for tokenizers that drop whitespace, and for chat templates that trim it. Counting characters is
C-speed (tens of microseconds a megabyte), where tokenizing a 5 MB body took a gateway 9-15 s.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from transformers import PreTrainedTokenizerBase

from common.errors import InvalidRequestError
from common.protocol import ChatCompletionRequest, CompletionRequest

WHITESPACE = (" ", "\n", "\t", "\r")
_longest: weakref.WeakKeyDictionary[Any, Any] = (
    weakref.WeakKeyDictionary()
)  # tokenizer -> its longest entry, in characters


def longest_piece(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one of the tokenizer's tokens spells (computed once per tokenizer)."""
    if tokenizer not in _longest:
        _longest[tokenizer] = max((len(piece) for piece in tokenizer.get_vocab()), default=1) or 1
    longest: int = _longest[tokenizer]
    return longest


def visible_chars(texts: Iterable[str]) -> int:
    """Characters that are not ASCII whitespace."""
    return sum(len(text) - sum(text.count(space) for space in WHITESPACE) for text in texts)


def prompt_texts(request: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """The texts the prompt's tokens will spell, at least (a chat's text contents; a completion's text prompt)."""
    if isinstance(request, ChatCompletionRequest):
        return [
            m.content if isinstance(m.content, str) else "".join(str(part.get("text") or "") for part in m.content)
            for m in request.messages
            if m.content
        ]
    prompts = request.prompt if isinstance(request.prompt, list) else [request.prompt]
    return [p for p in prompts if isinstance(p, str)]


def refuse_unfittable(
    request: ChatCompletionRequest | CompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    limit: int | None,
    holder: str = "this gateway",
) -> int:
    """A 400 ``context_length_exceeded`` for a prompt whose characters alone exceed ``limit`` tokens; else the
    characters it has (to decide whether tokenizing it is long work)."""
    texts = prompt_texts(request)
    chars = sum(map(len, texts))
    if limit is None or chars <= limit:  # the bound is at most the characters: it cannot refuse this one
        return chars
    fewest = -(-visible_chars(texts) // longest_piece(tokenizer))
    if fewest > limit:
        param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
        raise InvalidRequestError(
            f"the prompt has at least {fewest} tokens ({chars} characters, at most {longest_piece(tokenizer)} to a "
            f"token); {holder} accepts at most {limit}: send less",
            param=param,
            code="context_length_exceeded",
        )
    return chars

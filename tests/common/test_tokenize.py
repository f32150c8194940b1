"""Chats tokenized piece by piece, the repeated pieces once, exactly as a plain tokenization."""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken

from common.chat import render_chat
from common.protocol import ChatMessage
from common.tokenize import PieceCache
from specprefill.lab.demo_models import train_tokenizer
from tests.helpers import LONG_DOC


def test_pieces_give_exactly_the_plain_tokens_and_repeats_come_from_the_cache(tokenizer):
    cache = PieceCache(tokenizer)
    assert cache.enabled
    for question in ("What is it?", "  And this one?  ", "\nTell me\n\n"):
        messages = [ChatMessage(role="system", content=LONG_DOC), ChatMessage(role="user", content=question)]
        fast, plain = render_chat(tokenizer, messages, cache.encode), render_chat(tokenizer, messages)
        assert fast.token_ids == plain.token_ids and np.array_equal(fast.offsets, plain.offsets)
    assert "\n\n" + LONG_DOC in cache._pieces  # the system prompt (after its header) was tokenized once


def test_a_tokenizer_that_strips_beside_special_tokens_is_tokenized_whole():
    tokenizer = train_tokenizer(vocab_size=600)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<|x|>", lstrip=True, rstrip=True)]})
    cache = PieceCache(tokenizer)
    assert not cache.enabled
    text = "Hello <|x|> there"
    assert cache.encode(text)[0] == tokenizer(text, add_special_tokens=False).input_ids


def test_tokens_in_a_span_are_those_that_start_inside_it(tokenizer):
    messages = [ChatMessage(role="system", content=LONG_DOC), ChatMessage(role="user", content="Which one?")]
    rendered = render_chat(tokenizer, messages)
    for span in [s for s in rendered.content_spans(messages) if s] + [(0, 0), (5, 40), (0, len(rendered.text))]:
        expected = [i for i, (a, b) in enumerate(rendered.offsets) if b > a and span[0] <= a < span[1]]
        assert rendered.tokens_in(span) == expected
        assert rendered.token_mask(span).nonzero()[0].tolist() == expected

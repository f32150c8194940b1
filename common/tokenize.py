"""Tokenizing chats without redoing the parts that repeat.

A chat template puts special tokens between messages, and a tokenizer splits its input at its added tokens
before anything else. So the text between two special tokens tokenizes the same wherever it stands, and a
long system prompt, a shared document or a conversation's earlier turns need tokenizing once: later
requests look their pieces up (LRU, bounded by characters). Whether a tokenizer really behaves so (some
add a prefix space to every piece, or strip whitespace beside special tokens) is checked once, on a sample
chat, against a plain tokenization; where the two differ, every text is tokenized whole.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger("specprefill")

SAMPLE_CHAT = [{"role": "system", "content": "You answer briefly.\n  Be precise. "},
               {"role": "user", "content": " Hello there!\n\nWhat is 2 + 2?  "},
               {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3 + 3 ?"}]


class PieceCache:
    """``encode(text) -> (ids, offsets)`` as ``tokenizer(text, add_special_tokens=False)`` gives them (offsets as an
    int64 array [N, 2])."""

    def __init__(self, tokenizer, capacity_chars: int = 16 << 20) -> None:
        self.tokenizer = tokenizer
        self.capacity_chars = capacity_chars
        self._pieces: collections.OrderedDict[str, tuple[list[int], list[tuple[int, int]]]] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self.enabled = self._split is not None and capacity_chars > 0 and self._agrees()

    def encode(self, text: str) -> tuple[list[int], np.ndarray]:
        """Token IDs, and each token's character span as an int64 array [N, 2]."""
        if not self.enabled:
            return self._whole(text)
        ids, offsets, start = [], [], 0
        for piece in self._split.split(text):
            if piece:
                piece_ids, piece_offsets = self._piece(piece)
                ids += piece_ids
                offsets.append(piece_offsets + start)
            start += len(piece)
        return ids, np.concatenate(offsets) if offsets else np.zeros((0, 2), dtype=np.int64)

    def _piece(self, piece: str) -> tuple[list[int], np.ndarray]:
        with self._lock:
            found = self._pieces.get(piece)
            if found is not None:
                self._pieces.move_to_end(piece)
                return found
        found = self._whole(piece)
        if len(piece) <= self.capacity_chars:
            with self._lock:
                self._pieces[piece] = found
                self._chars += len(piece)
                while self._chars > self.capacity_chars:
                    evicted, _ = self._pieces.popitem(last=False)
                    self._chars -= len(evicted)
        return found

    def _whole(self, text: str) -> tuple[list[int], np.ndarray]:
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoding.input_ids, np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    def _agrees(self) -> bool:
        """A sample chat, then every added token between whitespace: split and whole must give one result."""
        try:
            text = self.tokenizer.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=True)
        except Exception:  # no chat template
            text = ""
        text += "".join(f" word {token}  word\n{token}\n " for token in self.tokenizer.get_added_vocab())
        self.enabled = True
        (split_ids, split_offsets), (whole_ids, whole_offsets) = self.encode(text), self._whole(text)
        agrees = split_ids == whole_ids and np.array_equal(split_offsets, whole_offsets)
        self._pieces.clear()
        self._chars = 0
        if not agrees:
            logger.info("this tokenizer does not split at its added tokens alone: chats are tokenized whole")
        return agrees


CONTEXT_TOKENS = 4  # tokens decoded before each one, so its text is what it adds (leading spaces, bytes)


def token_pieces(tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token's text, such that the pieces joined read as the decoded prompt.

    A token's piece is what decoding it adds after a few tokens before it (a word-start marker's space
    included). A token that ends in the middle of a character gets ``""`` and the token that completes the
    character gets the whole character.
    """
    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    pieces: list[str] = []
    pending = 0  # tokens before this one whose text is not out yet
    for i in range(len(token_ids)):
        first = i - pending  # the first token of this piece
        lo = max(0, first - CONTEXT_TOKENS)
        before, after = decode(token_ids[lo:first]), decode(token_ids[lo : i + 1])
        if after.endswith("\ufffd") and pending < CONTEXT_TOKENS and i + 1 < len(token_ids):
            pieces.append("")
            pending += 1
            continue
        pieces.append(after[len(before):] if after.startswith(before) else decode(token_ids[first : i + 1]))
        pending = 0
    return pieces

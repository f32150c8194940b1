"""Tokenizing chats without redoing the parts that repeat.

A chat template puts special tokens between messages, and a tokenizer splits its input at its added tokens
before anything else. So the text between two special tokens tokenizes the same wherever it stands, and a
long system prompt, a shared document or a conversation's earlier turns need tokenizing once: later
requests look their pieces up (LRU, bounded by the bytes it holds: a piece's text, its token IDs and their
character spans, each token 12 bytes as int32 arrays; as Python lists of ints they took 14–26 bytes a character,
and a bound of 16 million characters let a gateway that sees new documents grow by 3 MiB a minute for over an
hour). Whether a tokenizer really behaves so (some
add a prefix space to every piece, or strip whitespace beside special tokens) is checked once, on a sample
chat, against a plain tokenization; where the two differ, every text is tokenized whole.

A long piece that begins like an earlier one (the same document with another question after it) is tokenized
from the earlier piece's tokens: only the text from a few tokens before the point where the two part is
tokenized again, and that is kept only where it reproduces the earlier tokens it overlaps.

A whole text that begins like a recent one (a chat's next turn, an agent's next step: the same system prompt, tools
and earlier turns, then more) takes the recent one's tokens up to the last added token that begins inside the part
the two share (far enough inside that no added token there could read differently), and only the rest is split and
looked up: the text before that added token splits into the same pieces in both, so its tokens are the same. An
agent's turn of 50 messages spent 1 ms a request looking up its 100 pieces one by one.

A long new piece (a fresh document) is tokenized in segments at once, on the tokenizer's own threads
(``encode_batch``): each segment starts a margin before the previous one ends, and two neighbours are joined
where they agree on ``OVERLAP`` tokens in a row, at the same characters, before the earlier one's cut end. A
seam where they never agree sends the piece to a plain tokenization. A 32k-token document took 100 ms on a
GPU server's CPU, a tenth of an H100's whole compressed request.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("specprefill")

SAMPLE_CHAT = [
    {"role": "system", "content": "You answer briefly.\n  Be precise. "},
    {"role": "user", "content": " Hello there!\n\nWhat is 2 + 2?  "},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3 ?"},
]


LONG_PIECE = 4096  # characters: a piece this long may be tokenized from an earlier one it begins with
HEAD_CHARS = 256  # characters that find that earlier piece
OVERLAP = 16  # tokens before the earlier piece's end tokenized again, and required to come out the same
SEGMENT_CHARS = 8192  # characters: a new piece is tokenized in segments of at least this many, in parallel
MARGIN_CHARS = 512  # characters a segment starts before the previous one ends: room to realign and agree
RECENT_TEXTS = 8  # whole texts kept, each with its tokens, for a later text that begins like one of them
RECENT_MIN_CHARS = 2048  # shorter texts are split and looked up as they come


class PieceCache:
    """``encode(text) -> (ids, offsets)`` as ``tokenizer(text, add_special_tokens=False)`` gives them (offsets as an
    int64 array [N, 2])."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, capacity_bytes: int = 16 << 20) -> None:
        self.tokenizer = tokenizer
        self.capacity_bytes = capacity_bytes
        # piece -> (token IDs, spans [N, 2]), both int32, and what the entry holds in bytes
        self._pieces: collections.OrderedDict[str, tuple[np.ndarray, np.ndarray, int]] = collections.OrderedDict()
        self.bytes = 0
        self._heads: dict[str, str] = {}  # a long piece's first characters -> that piece (the latest)
        self.extended = 0  # long pieces tokenized from an earlier piece they begin with
        self._lock = threading.Lock()
        self.segmented = 0  # new pieces tokenized in segments
        # recent whole texts by their first characters: (text, ids, offsets, each added token's character and
        # token index [K, 2], the entry's bytes), bounded by a quarter of ``capacity_bytes`` in all
        self._recent: collections.OrderedDict[str, tuple[str, np.ndarray, np.ndarray, np.ndarray, int]] = (
            collections.OrderedDict()
        )
        self.recent_bytes = 0
        self.continued = 0  # whole texts that took a recent text's tokens for the part they share
        self._parallel = bool(getattr(tokenizer, "is_fast", False))  # a batch runs on the Rust tokenizer's threads
        self._rust = _plain_rust(tokenizer)
        self._workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
        self._longest_added = max(map(len, added), default=0)
        self.enabled = self._split is not None and capacity_bytes > 0 and self._agrees()

    def encode(self, text: str) -> tuple[list[int], np.ndarray]:
        """Token IDs, and each token's character span as an int64 array [N, 2]."""
        ids, offsets = self.encode_arrays(text)
        return ids.tolist(), offsets

    def encode_arrays(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``encode``'s token IDs as an int64 array [N], which the planner reads them as (a list of 40,000 takes
        1-2 ms to make into one), and the spans."""
        if not self.enabled or self._split is None:
            whole_ids, whole_offsets = self._whole(text)
            return whole_ids.astype(np.int64), whole_offsets.astype(np.int64)
        if len(text) < RECENT_MIN_CHARS:
            return self._pieces_of(text, 0)[:2]
        head = text[:HEAD_CHARS]
        with self._lock:
            recent = self._recent.get(head)
        ids, offsets, added = self._continued(text, recent) if recent is not None else self._pieces_of(text, 0)
        size = sys.getsizeof(text) + ids.nbytes + offsets.nbytes + added.nbytes
        if size <= self.capacity_bytes // 4:
            with self._lock:
                if (old := self._recent.pop(head, None)) is not None:
                    self.recent_bytes -= old[4]
                self._recent[head] = (text, ids, offsets, added, size)
                self.recent_bytes += size
                while len(self._recent) > RECENT_TEXTS or self.recent_bytes > self.capacity_bytes // 4:
                    self.recent_bytes -= self._recent.popitem(last=False)[1][4]
                self._evict()
        return ids, offsets

    def _continued(
        self, text: str, recent: tuple[str, np.ndarray, np.ndarray, np.ndarray, int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``text``'s tokens from a recent text's up to the last added token that starts at least one added
        token's length inside the part both share (every added token before it, and it, match there alike, so
        both split into the same pieces before it), then the rest split and looked up."""
        earlier, ids, offsets, added, _ = recent
        shared = _common_prefix(text, earlier)
        k = int(np.searchsorted(added[:, 0], shared - self._longest_added, side="right")) - 1
        if k < 0:
            return self._pieces_of(text, 0)
        cut, n = int(added[k, 0]), int(added[k, 1])  # the added token's character, and the tokens before it
        rest_ids, rest_offsets, rest_added = self._pieces_of(text[cut:], cut, n)
        self.continued += 1
        return (
            np.concatenate([ids[:n], rest_ids]),
            np.concatenate([offsets[:n], rest_offsets]),
            np.concatenate([added[:k], rest_added]),
        )

    def _pieces_of(self, text: str, start: int, before: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``text`` split at its added tokens, each piece looked up (or tokenized): its IDs, its offsets, and each
        added token's character and token index, shifted by ``start`` characters and ``before`` tokens."""
        assert self._split is not None
        ids: list[np.ndarray] = []
        offsets: list[np.ndarray] = []
        added: list[tuple[int, int]] = []
        for number, piece in enumerate(self._split.split(text)):
            if number % 2:  # an added token (re.split puts each match between two texts)
                added.append((start, before))
            if piece:
                piece_ids, piece_offsets = self._piece(piece)
                ids.append(piece_ids)
                offsets.append(piece_offsets.astype(np.int64) + start)
                before += len(piece_ids)
            start += len(piece)
        starts = np.asarray(added, dtype=np.int64).reshape(-1, 2)
        if not ids:
            return np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int64), starts
        return np.concatenate(ids).astype(np.int64), np.concatenate(offsets), starts

    def _piece(self, piece: str) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            held = self._pieces.get(piece)
            if held is not None:
                self._pieces.move_to_end(piece)
                return held[0], held[1]
            head = self._heads.get(piece[:HEAD_CHARS]) if len(piece) > LONG_PIECE else None
            earlier = self._pieces.get(head) if head is not None else None
        extended = self._extended(piece, head, earlier[0], earlier[1]) if head is not None and earlier else None
        found = extended or self._segmented(piece)
        size = sys.getsizeof(piece) + found[0].nbytes + found[1].nbytes
        if size <= self.capacity_bytes:
            with self._lock:
                if (old := self._pieces.pop(piece, None)) is not None:  # tokenized twice at once
                    self.bytes -= old[2]
                self._pieces[piece] = (found[0], found[1], size)
                self.bytes += size
                if len(piece) > LONG_PIECE:
                    self._heads[piece[:HEAD_CHARS]] = piece
                self._evict()
        return found

    def _evict(self) -> None:
        """The least recently used pieces out until the pieces and the recent texts fit ``capacity_bytes``
        (under the lock)."""
        while self._pieces and self.bytes + self.recent_bytes > self.capacity_bytes:
            evicted, (_, _, evicted_size) = self._pieces.popitem(last=False)
            self.bytes -= evicted_size
            if self._heads.get(evicted[:HEAD_CHARS]) == evicted:
                del self._heads[evicted[:HEAD_CHARS]]

    def _extended(
        self, text: str, earlier: str, ids: np.ndarray, offsets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``text``'s tokens from those of an ``earlier`` piece it begins like (the same document, then another
        question): the earlier tokens up to ``OVERLAP`` tokens before the point where the two texts part are
        kept, and the rest is tokenized again. Kept only where the new tokenization reproduces those
        ``OVERLAP`` earlier tokens exactly (the two realign there, so every later token is the new text's
        own); else None, and the text is tokenized whole."""
        shared = _common_prefix(text, earlier)
        inside = int(np.searchsorted(offsets[:, 1], shared, side="right"))  # earlier tokens ending by then
        cut = inside - OVERLAP
        if cut <= OVERLAP:
            return None
        start = int(offsets[cut, 0])
        tail_ids, tail_offsets = self._whole(text[start:])
        tail_offsets = tail_offsets + start
        if not _agree(ids, offsets, cut, tail_ids, tail_offsets, 0, OVERLAP - 1):
            return None
        self.extended += 1
        return np.concatenate([ids[:cut], tail_ids]), np.concatenate([offsets[:cut], tail_offsets])

    def _segmented(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``text``'s tokens from segments tokenized in parallel and joined where neighbours agree; a short
        text, one CPU, or a seam without agreement: a plain tokenization."""
        n_segments = min(self._workers, len(text) // SEGMENT_CHARS)
        if n_segments < 2 or not self._parallel:
            return self._whole(text)
        ends = [round(len(text) * (i + 1) / n_segments) for i in range(n_segments)]
        starts = [0] + [end - MARGIN_CHARS for end in ends[:-1]]
        batch = self.tokenizer(
            [text[a:b] for a, b in zip(starts, ends)], add_special_tokens=False, return_offsets_mapping=True
        )
        segments = [
            (np.asarray(ids, dtype=np.int32), _offsets(pairs, start))
            for ids, pairs, start in zip(batch.input_ids, batch["offset_mapping"], starts)
        ]
        kept = []  # each segment's tokens from its seam with the previous one to its seam with the next
        ids, offsets = segments[0]
        for end, (tail_ids, tail_offsets) in zip(ends[:-1], segments[1:]):
            seam = _seam(ids, offsets, end, tail_ids, tail_offsets)
            if seam is None:
                return self._whole(text)
            j, t = seam
            kept.append((ids[:j], offsets[:j]))
            ids, offsets = tail_ids[t:], tail_offsets[t:]
        kept.append((ids, offsets))
        self.segmented += 1
        return np.concatenate([part for part, _ in kept]), np.concatenate([p for _, p in kept])

    def _whole(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        if self._rust is not None:  # what the call below runs, without transformers' wrapping (50 µs a call)
            encoding = self._rust.encode(text, add_special_tokens=False)
            return np.asarray(encoding.ids, dtype=np.int32), _offsets(encoding.offsets, 0)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return np.asarray(encoded.input_ids, dtype=np.int32), _offsets(encoded["offset_mapping"], 0)

    def _agrees(self) -> bool:
        """A sample chat, then every added token between whitespace: split and whole must give one result."""
        try:
            text = str(self.tokenizer.apply_chat_template(SAMPLE_CHAT, tokenize=False, add_generation_prompt=True))
        except Exception:  # no chat template
            text = ""
        text += "".join(f" word {token}  word\n{token}\n " for token in self.tokenizer.get_added_vocab())
        self.enabled = True
        (split_ids, split_offsets), (whole_ids, whole_offsets) = self.encode(text), self._whole(text)
        agrees = split_ids == whole_ids.tolist() and np.array_equal(split_offsets, whole_offsets)
        self._pieces.clear()
        self._heads.clear()
        self._recent.clear()
        self.bytes = 0
        if not agrees:
            logger.info("this tokenizer does not split at its added tokens alone: chats are tokenized whole")
        return agrees


def _offsets(pairs: list[tuple[int, int]], start: int) -> np.ndarray:
    return np.asarray(pairs, dtype=np.int32).reshape(-1, 2) + np.int32(start)


def _agree(
    ids: np.ndarray, offsets: np.ndarray, j: int, tail_ids: np.ndarray, tail_offsets: np.ndarray, t: int, n: int
) -> bool:
    """Whether two tokenizations of one text (offsets in its characters) give the same ``n`` tokens, at the same
    characters, from token ``j`` of the first and ``t`` of the second: they have realigned there, so either one's
    tokens from that point on stand for both (the rule the cache's joins rest on)."""
    return (
        len(ids) >= j + n
        and len(tail_ids) >= t + n
        and np.array_equal(ids[j : j + n], tail_ids[t : t + n])
        and np.array_equal(offsets[j : j + n], tail_offsets[t : t + n])
    )


def _seam(
    ids: np.ndarray, offsets: np.ndarray, cut_end: int, tail_ids: np.ndarray, tail_offsets: np.ndarray
) -> tuple[int, int] | None:
    """Where the tokens of a text cut at ``cut_end`` (``ids``) hand over to those of a segment that starts before
    that cut (``tail_ids``; offsets in the whole text's characters): the first token where both begin at the same
    character and ``_agree`` for ``OVERLAP`` tokens, all ending a margin before the cut (its last words may be cut
    through). (index in ``ids``, index in ``tail_ids``), or None where they never agree."""
    if not len(tail_ids):
        return None
    overlap = int(np.searchsorted(tail_offsets[:, 0], cut_end, side="left"))  # tail tokens starting before the cut
    where = {a: t for t, a in enumerate(tail_offsets[:overlap, 0].tolist())}
    first = int(np.searchsorted(offsets[:, 0], tail_offsets[0, 0], side="left"))
    safe = int(np.searchsorted(offsets[:, 1], cut_end - MARGIN_CHARS // 4, side="right"))  # ending by then
    for j in range(first, safe - OVERLAP + 1):
        t = where.get(int(offsets[j, 0]))
        if t is not None and _agree(ids, offsets, j, tail_ids, tail_offsets, t, OVERLAP):
            return j, t
    return None


def _common_prefix(a: str, b: str, step: int = 4096) -> int:
    """The length of the longest common prefix of two strings: equal blocks of ``step`` characters skipped, then
    bisection over slice comparisons inside the first block that differs (each character copied about once, where
    bisection over the whole strings copied a 200,000-character prompt 18 times)."""
    n = min(len(a), len(b))
    start = 0
    while start + step <= n and a[start : start + step] == b[start : start + step]:
        start += step
    low, high = start, min(start + step, n)
    while low < high:
        middle = (low + high + 1) // 2
        if a[start:middle] == b[start:middle]:
            low = middle
        else:
            high = middle - 1
    return low


CONTEXT_TOKENS = 4  # tokens decoded before each one, so its text is what it adds (leading spaces, bytes)


def token_pieces(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> list[str]:
    """Each token's text, such that the pieces joined read as the decoded prompt.

    A token's piece is what decoding it adds after a few tokens before it (a word-start marker's space
    included). A token that ends in the middle of a character gets ``""`` and the token that completes the
    character gets the whole character.
    """

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

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
        pieces.append(after[len(before) :] if after.startswith(before) else decode(token_ids[first : i + 1]))
        pending = 0
    return pieces


def _plain_rust(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The fast tokenizer's own Rust tokenizer, where calling it gives what ``tokenizer(text,
    add_special_tokens=False)`` gives (no truncation or padding of its own for transformers to switch off); else
    None."""
    rust = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if rust is None or getattr(rust, "truncation", None) is not None or getattr(rust, "padding", None) is not None:
        return None
    return rust

"""Prefix-cache blocks: the identity of a run of tokens at their positions, as vLLM's prefix cache keys it.

A prompt is cut into blocks of ``block_size`` tokens; only full blocks count. A block's hash covers its
parent's hash, its tokens and its extra keys, so two blocks are one only if everything before them is the
same too. The one extra key here is a block's positions where they are not the default ones (``position_key``):
kept tokens at gapped positions are reusable only at those positions. That is what the vLLM plugin adds to
vLLM's block hash, and what vLLM publishes in its KV events' ``extra_keys``, so a block known from an engine's
events (tokens, extra keys, parent) is the same block as one hashed here from a prompt. The reference engine
keys its cache with these hashes, and the gateway models an engine's cache with the same rule.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.sequences import longest_prefix

Ints = Sequence[int] | np.ndarray  # token IDs or positions: a list or an int array


def position_key(positions: Sequence[int]) -> str:
    """The extra key of a block at non-default positions: the vLLM plugin's ``block_key`` (the plugin imports
    nothing of ours; a test holds the two equal)."""
    return hashlib.sha256(",".join(map(str, positions)).encode()).hexdigest()[:32]


def block_hash(parent: bytes, token_ids: Sequence[int] | np.ndarray, extra: Sequence[Any] | None) -> bytes:
    """One block's hash from its parent's, its tokens and its extra keys (None or empty: none)."""
    payload = np.asarray(token_ids, dtype="<i8").tobytes()
    if extra:
        payload += b"\x00" + "\x00".join(map(str, extra)).encode()
    return hashlib.blake2b(parent + payload, digest_size=16).digest()


def block_keys(
    token_ids: Ints, position_ids: Ints | None, block_size: int, offset: int = 0
) -> list[tuple[np.ndarray, tuple[str] | None]]:
    """Each full block's tokens and extra keys (positions default to 0..n-1; ``offset``: where ``token_ids``
    begin in their prompt, for the default positions)."""
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    tokens = np.asarray(token_ids[: n_blocks * block_size], dtype="<i8").reshape(n_blocks, block_size)
    if position_ids is None:
        return [(block, None) for block in tokens]
    positions = np.asarray(position_ids[: n_blocks * block_size], dtype="<i8").reshape(n_blocks, block_size)
    default = offset + np.arange(n_blocks * block_size, dtype="<i8").reshape(n_blocks, block_size)
    moved = (positions != default).any(axis=1).tolist()
    return [
        (block, (position_key(at.tolist()),) if move else None) for block, at, move in zip(tokens, positions, moved)
    ]


def block_hashes(
    token_ids: Ints, position_ids: Ints | None, block_size: int, parent: bytes = b"", offset: int = 0
) -> list[bytes]:
    """One hash per full block (``block_keys``), each chained to the one before."""
    return chain(block_keys(token_ids, position_ids, block_size, offset), parent)


def chain(keys: Sequence[tuple[Ints, Sequence[Any] | None]], parent: bytes = b"") -> list[bytes]:
    """The hashes of blocks given as (tokens, extra keys), each chained to the one before, the first to ``parent``."""
    hashes = []
    for tokens, extra in keys:
        parent = block_hash(parent, tokens, extra)
        hashes.append(parent)
    return hashes


def reusable_blocks(n_cached_blocks: int, n_tokens: int, block_size: int) -> int:
    """How many cached leading blocks a prompt of ``n_tokens`` may reuse: at least its last token is always
    computed (its logits are the first generated token's), as vLLM does."""
    return min(n_cached_blocks, (n_tokens - 1) // block_size)


class BlockHasher:
    """``block_hashes`` that keeps the chains of the last ``capacity`` prompts: a prompt that begins like one of
    them (a chat's next turn, the same system prompt or document again) hashes only the blocks after the part
    they share. The hashes are exactly ``block_hashes``'s. Thread-safe."""

    def __init__(self, block_size: int, capacity: int = 16) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._recent: collections.deque[tuple[np.ndarray, list[bytes]]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def __call__(self, token_ids: Ints, position_ids: Ints | None) -> list[bytes]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        positions = (
            np.arange(len(tokens), dtype=np.int64)
            if position_ids is None
            else np.asarray(position_ids, dtype=np.int64)[: len(tokens)]
        )
        # each token and its position in one integer: one comparison finds where tokens or positions part
        # (token IDs and positions both fit 32 bits)
        keys = (tokens << 32) | positions
        with self._lock:
            index, shared = longest_prefix(keys, enumerate(entry[0] for entry in self._recent))
            reused = self._recent[index][1][: shared // self.block_size] if index is not None else []
        start = len(reused) * self.block_size
        hashes = reused + block_hashes(
            tokens[start:], positions[start:], self.block_size, parent=reused[-1] if reused else b"", offset=start
        )
        with self._lock:
            self._recent.appendleft((keys, hashes))
        return hashes

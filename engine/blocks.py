"""Prefix-cache blocks: the identity of a run of tokens at their positions, as vLLM's prefix cache keys it.

A prompt is cut into blocks of ``block_size`` tokens; only full blocks count. A block's hash covers its
parent's hash, its tokens and their positions, so two blocks are one only if everything before them is the
same too, and kept tokens at gapped positions are reusable only at those positions (the vLLM plugin adds
non-default positions to vLLM's block hash for the same reason). The reference engine keys its cache with
these hashes, and the gateway models an engine's cache with the same rule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def block_hashes(token_ids: Sequence[int], position_ids: Sequence[int] | None, block_size: int,
                 parent: bytes = b"") -> list[bytes]:
    """One hash per full block of ``token_ids`` (positions default to 0..n-1), each chained to the one before."""
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    tokens = np.asarray(token_ids[: n_blocks * block_size], dtype="<i8").reshape(n_blocks, block_size)
    if position_ids is None:
        positions = np.arange(n_blocks * block_size, dtype="<i8").reshape(n_blocks, block_size)
    else:
        positions = np.asarray(position_ids[: n_blocks * block_size], dtype="<i8").reshape(n_blocks, block_size)
    hashes = []
    for block_tokens, block_positions in zip(tokens, positions):
        parent = hashlib.blake2b(parent + block_tokens.tobytes() + block_positions.tobytes(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


def reusable_blocks(n_cached_blocks: int, n_tokens: int, block_size: int) -> int:
    """How many cached leading blocks a prompt of ``n_tokens`` may reuse: at least its last token is always
    computed (its logits are the first generated token's), as vLLM does."""
    return min(n_cached_blocks, (n_tokens - 1) // block_size)

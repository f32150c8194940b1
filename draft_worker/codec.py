"""Scores on the wire and in caches: plain little-endian float32 arrays (never pickles, readable anywhere)."""

from __future__ import annotations

import base64

import numpy as np
import torch


def encode_scores(scores: torch.Tensor) -> bytes:
    return scores.detach().cpu().numpy().astype("<f4", copy=False).tobytes()


def decode_scores(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())


def scores_to_text(scores: torch.Tensor) -> str:
    """For JSON: the float32 bytes, base64."""
    return base64.b64encode(encode_scores(scores)).decode()


def scores_from_text(text: str) -> torch.Tensor:
    return decode_scores(base64.b64decode(text))

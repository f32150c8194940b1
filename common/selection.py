"""Selection: token scores in, kept indices out. Pure tensor code, no model.

``select_tokens`` is the one rule for what the target reads. The gateway, ``specprefill score``, the
eval's baselines and the inspector all call it, so they all show the same tokens. The draft worker scores; it
never selects.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch


class ConfigError(ValueError):
    """A scoring or selection option a user set is out of range."""


@dataclass(slots=True, frozen=True)
class SelectionConfig:
    """How scored prompt tokens are selected: in chunks, with the prompt's ends protected."""

    chunk_size: int = 32
    """Tokens are kept in contiguous chunks of this size; 1 selects single tokens."""
    protect_first: int = 4
    """The first N prompt tokens are always kept (one by one, counted in the keep budget); 0 turns it off."""
    protect_last: int = 32
    """The last N prompt tokens are always kept (one by one, counted in the keep budget); 0 turns it off."""
    max_chunks: int = 0
    """A selection keeps at most about this many chunks: where the budget buys more chunks of ``chunk_size``, the
    chunks double until it does not (``chunk_for``), so a long prompt at a high keep rate is read in fewer, longer
    runs. 0: off, every selection in chunks of ``chunk_size`` (the paper's). This project's option, measured on
    the quality page, not the paper's."""
    min_chunks: int = 0
    """A selection keeps at least about this many chunks: where the budget buys fewer chunks of ``chunk_size``,
    the chunks halve (down to single tokens) until it does not, so a short prompt at a low keep rate is read in
    more places. 0: off. With ``max_chunks``, at most half of it (one chunk size always fits between them). This
    project's option, measured on the quality page, not the paper's."""

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.protect_first < 0 or self.protect_last < 0:
            raise ConfigError("protect_first and protect_last must be >= 0")
        if self.max_chunks < 0:
            raise ConfigError(f"max_chunks must be >= 0 (0: off), got {self.max_chunks}")
        if self.min_chunks < 0:
            raise ConfigError(f"min_chunks must be >= 0 (0: off), got {self.min_chunks}")
        if self.min_chunks and self.max_chunks and 2 * self.min_chunks > self.max_chunks:
            raise ConfigError(
                f"min_chunks ({self.min_chunks}) must be at most half of max_chunks ({self.max_chunks}), so that "
                "a chunk size fits between them: lower min_chunks or raise max_chunks"
            )

    def chunk_for(self, length: int, keep_rate: float) -> int:
        """The chunk size a selection of ``keep_rate`` of a ``length``-token prompt is cut in: ``chunk_size``,
        doubled while the budget (``chunk_budget``) buys more than ``max_chunks`` chunks of it, or halved while it
        buys fewer than ``min_chunks``."""
        chunk = self.chunk_size
        if keep_rate >= 1.0:
            return chunk
        if self.max_chunks:
            while chunk < length and chunk_budget(length, chunk, keep_rate) > self.max_chunks:
                chunk *= 2
        if self.min_chunks:
            while chunk > 1 and chunk_budget(length, chunk, keep_rate) < self.min_chunks:
                chunk //= 2
        return chunk


def chunk_budget(length: int, chunk_size: int, keep_rate: float) -> int:
    """How many chunks a selection keeps: ceil(n_chunks × keep_rate) of the prompt's ceil(length / chunk_size),
    robust to float error (10 × 0.3 is 3.0000000000000004 in floats)."""
    return math.ceil(round(math.ceil(length / chunk_size) * keep_rate, 9))


@dataclass(slots=True, frozen=True)
class AutoKeepRate:
    """``x-keep-rate: auto``: the keep rate chosen per prompt from the draft's scores. The kept chunks are the
    fewest whose share of the score mass reaches ``target`` (the mass of the tokens not kept anyway: protection
    aside), as AttnComp keeps the fewest documents whose attention passes a threshold; the rate is those
    chunks and the tokens kept anyway, between ``floor`` and ``ceiling``. A prompt whose question points at one
    paragraph keeps few chunks; one whose importance spreads over the whole document keeps many."""

    target: float = 0.5
    floor: float = 0.05
    ceiling: float = 0.3

    def __post_init__(self) -> None:
        for name in ("target", "floor", "ceiling"):
            value = getattr(self, name)
            if not (0.0 < value <= 1.0):  # also false for NaN
                raise ConfigError(f"the auto keep rate's {name} must be a number in (0, 1], got {value!r}")
        if self.floor > self.ceiling:
            raise ConfigError(f"the auto keep rate's floor ({self.floor}) is above its ceiling ({self.ceiling})")

    def rate(self, scores: torch.Tensor, chunk_size: int, protected: torch.Tensor | None = None) -> float:
        """The keep rate for these token scores [S] (``protected``: the boolean [S] mask of tokens kept anyway)."""
        length = scores.numel()
        n_chunks = math.ceil(length / chunk_size)
        held = protected if protected is not None else torch.zeros(length, dtype=torch.bool)
        mass = scores.float().clamp_min(0).masked_fill(held, 0.0)
        chunk_mass = _pad_with_false(mass, n_chunks * chunk_size).view(n_chunks, chunk_size).sum(dim=1)
        total = float(chunk_mass.sum())
        if not math.isfinite(total) or total <= 0:
            return self.ceiling  # nothing to tell the chunks apart: as much as allowed
        share = torch.cumsum(torch.sort(chunk_mass, descending=True).values, dim=0) / total
        chunks = min(n_chunks, int(torch.searchsorted(share, torch.tensor(self.target * (1 - 1e-6)))) + 1)
        rate = (chunks * chunk_size + int(held.sum())) / (n_chunks * chunk_size)
        return min(self.ceiling, max(self.floor, rate))


KeepRate = float | AutoKeepRate  # a fixed rate, or the mass rule

DEFAULT_KEEP_RATE: Literal["auto"] = "auto"
"""The server's and ``specprefill score``'s default keep rate: the mass rule at its default target and bounds. On
the real pair (Qwen2.5-Coder-0.5B choosing for the 1.5B, 30 haystacks a cell) it kept keep 0.3's accuracy within
its 95% interval on the passkey, fact and code tasks at 8,000 and 16,000 tokens, at a mean applied rate of 0.11-0.13,
and was never below fixed keep 0.1 (docs/results/quality.md); a fixed rate was 0.3 until then."""


def validate_keep_rate(keep_rate: float) -> float:
    """A keep rate is a finite number in (0, 1]: checked once, where it comes in (the settings, the command line,
    a request's header or body), with this one rule."""
    if not (0.0 < keep_rate <= 1.0):  # also false for NaN
        raise ConfigError(f"keep rate must be a number in (0, 1], got {keep_rate!r}")
    return float(keep_rate)


def applied_keep_rate(
    keep_rate: KeepRate,
    token_ids: Sequence[int],
    scores: torch.Tensor,
    config: SelectionConfig,
    special_ids: Collection[int] = (),
    keep: torch.Tensor | None = None,
) -> float:
    """The keep rate ``select_tokens`` applies: a fixed one as it is, ``auto`` as the scores choose it (over chunks
    of ``chunk_size``; ``max_chunks`` then cuts the selection at that rate, as at a fixed one)."""
    if not isinstance(keep_rate, AutoKeepRate):
        return keep_rate
    return keep_rate.rate(scores, config.chunk_size, always_kept(token_ids, config, special_ids, keep))


def select_tokens(
    token_ids: Sequence[int],
    scores: torch.Tensor,
    keep_rate: KeepRate,
    config: SelectionConfig,
    special_ids: Collection[int] = (),
    keep: torch.Tensor | None = None,
) -> list[int]:
    """The indices of the prompt tokens the target reads, sorted; they are also the kept tokens' positions.

    token_ids: the prompt [S]; scores: one per token [S]. The top chunks of ``config.chunk_for`` (``chunk_size``,
    longer where ``max_chunks`` caps how many) by mean score within a budget of ceil(n_chunks × keep_rate)
    chunks' tokens, after the tokens that are always kept, one by one (``select_chunks``): the first
    ``protect_first``, the last ``max(protect_last, 1)`` (the last prompt token always goes, so the first
    generated token stands right after the prompt), every token in ``special_ids`` (the chat template's
    markup: BOS, role headers), and the tokens ``keep`` marks (a boolean [S] mask: a system prompt kept
    whole). Keep rate 1 keeps everything; ``auto`` is the rate ``applied_keep_rate`` chooses from the scores.
    """
    keep_rate = applied_keep_rate(keep_rate, token_ids, scores, config, special_ids, keep)
    assert 0.0 < keep_rate <= 1.0, "validated where it came in (validate_keep_rate)"
    assert scores.dim() == 1 and scores.numel() == len(token_ids), "one score per token"
    if keep_rate >= 1.0:
        return list(range(len(token_ids)))
    protected = always_kept(token_ids, config, special_ids, keep)
    chunk = config.chunk_for(len(token_ids), keep_rate)
    return select_chunks(scores, keep_rate, chunk, protected).tolist()


def always_kept(
    token_ids: Sequence[int],
    config: SelectionConfig,
    special_ids: Collection[int] = (),
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean [S] mask of the tokens ``select_tokens`` keeps at any keep rate: the protected ends, the
    template's special tokens and ``keep``. They are kept one by one, each spending one token of the budget."""
    length = len(token_ids)
    extra = keep.clone() if keep is not None else torch.zeros(length, dtype=torch.bool)
    if special_ids:
        extra |= torch.isin(torch.as_tensor(list(token_ids)), torch.as_tensor(sorted(special_ids)))
    mask = protected_mask(length, config.protect_first, max(config.protect_last, 1), extra)
    assert mask is not None  # the last token at least
    return mask


def extend_selection(
    token_ids: Sequence[int],
    scores: torch.Tensor,
    keep_rate: float,
    config: SelectionConfig,
    reused: Sequence[int],
    start: int,
    special_ids: Collection[int] = (),
    keep: torch.Tensor | None = None,
) -> list[int]:
    """An earlier selection's kept indices below ``start`` (the point up to which the earlier prompt and this
    one agree), then ``select_tokens`` on the rest of the prompt, as if it began at ``start``.

    The kept run below ``start`` is exactly the earlier request's, so the engine's prefix cache already holds it.
    """
    assert 0 < start < len(token_ids)
    head = [i for i in reused if i < start]
    tail_config = replace(config, protect_first=0)
    tail_keep = keep[start:] if keep is not None else None
    tail = select_tokens(token_ids[start:], scores[start:], keep_rate, tail_config, special_ids, tail_keep)
    return head + [start + i for i in tail]


def fill_blocks(kept: Sequence[int], boundary: int, block: int, floor: int = 0) -> list[int]:
    """``kept`` (sorted) with the free positions nearest below ``boundary``, and at or above ``floor``, added until
    the kept tokens below it fill whole blocks of ``block`` tokens; fewer than ``block`` are added, none where
    too few are free.

    An engine's prefix cache holds whole blocks (vLLM's CPU build: 128 tokens): a later prompt that begins like
    this one up to ``boundary`` (the next user of a system prompt, the next question about a document) then
    finds every kept token before it cached, where it would otherwise read the last part-filled block anew.
    ``floor``: past the kept tokens the engine already holds. A position added below one of them moves it, and
    every kept token after it, to another place in the sequence the engine reads, and the engine's blocks from
    there on no longer match.
    """
    below = bisect.bisect_left(kept, boundary)
    missing = -below % block if block > 1 and boundary > 0 else 0
    if not missing:
        return list(kept)
    taken, fill, position = set(kept[:below]), list[int](), boundary - 1
    while len(fill) < missing and position >= floor:
        if position not in taken:
            fill.append(position)
        position -= 1
    return sorted([*kept, *fill]) if len(fill) == missing else list(kept)


def kept_importance(scores: torch.Tensor, kept: Sequence[int], end: int, chunk_size: int) -> float:
    """The importance a selection keeps in the whole chunks below ``end``: the sum of the mean scores of the
    chunks it keeps there, chunks cut as ``select_chunks`` cuts them."""
    n_chunks = end // chunk_size
    if n_chunks == 0:
        return 0.0
    chunk_scores = scores[: n_chunks * chunk_size].float().view(n_chunks, chunk_size).mean(dim=1)
    chunks = sorted({i // chunk_size for i in kept if i < n_chunks * chunk_size})
    return float(chunk_scores[chunks].sum()) if chunks else 0.0


def protected_mask(
    length: int, protect_first: int, protect_last: int, extra: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Boolean [S] mask of tokens that must be kept, or None when nothing is protected.

    extra: a boolean [S] mask of further tokens to keep.
    """
    if not (protect_first or protect_last or (extra is not None and bool(extra.any()))):
        return None
    mask = torch.zeros(length, dtype=torch.bool)
    mask[: min(protect_first, length)] = True
    if protect_last:
        mask[max(length - protect_last, 0) :] = True
    if extra is not None:
        mask |= extra
    return mask


def select_chunks(
    scores: torch.Tensor, keep_rate: float, chunk_size: int, protected: torch.Tensor | None = None
) -> torch.Tensor:
    """Kept token indices, sorted.

    scores: [S] token scores. The sequence is cut into contiguous chunks of ``chunk_size`` (the last may be
    shorter); a chunk's score is the mean of its tokens' scores, and the top ceil(n_chunks × keep_rate)
    chunks are kept, as in SpecPrefill.

    protected: a boolean [S] mask of tokens kept at any keep rate. They are kept one by one and spend the
    budget, counted in tokens (ceil(n_chunks × keep_rate) × chunk_size), one each; the best chunks spend the
    rest, each its tokens not already kept, until the budget is spent (the last chunk may overshoot it by
    less than a chunk). Without protection this is the top chunks exactly; when protection alone exceeds
    the budget, protection wins.
    """
    assert scores.dim() == 1 and scores.numel() > 0
    length = scores.numel()
    n_chunks = math.ceil(length / chunk_size)
    budget = chunk_budget(length, chunk_size, keep_rate)
    if budget >= n_chunks:
        return torch.arange(length)

    padded = _pad_with_nan(scores.float(), n_chunks * chunk_size)
    chunk_scores = padded.view(n_chunks, chunk_size).nanmean(dim=1)  # [C]
    # stable descending sort: ties go to the earlier chunk, so selection is deterministic
    order = torch.sort(chunk_scores, descending=True, stable=True).indices
    protected = protected if protected is not None else torch.zeros(length, dtype=torch.bool)
    # a chunk costs its slots (a short last chunk costs a whole one) that protection does not already keep;
    # with nothing protected every chunk costs chunk_size, so the budget takes exactly the top chunks
    in_chunk = _pad_with_false(protected, n_chunks * chunk_size).view(n_chunks, chunk_size).sum(dim=1)
    cost = (chunk_size - in_chunk)[order]
    held, tokens = int(in_chunk.sum()), budget * chunk_size
    spent = held + torch.cumsum(cost, dim=0)  # the budget spent after taking each chunk of ``order``
    taken = int(torch.searchsorted(spent, tokens)) + 1 if held < tokens else 0
    kept_chunks = torch.zeros(n_chunks, dtype=torch.bool)
    kept_chunks[order[:taken]] = True
    token_kept = kept_chunks.repeat_interleave(chunk_size)[:length] | protected
    return token_kept.nonzero().squeeze(1)


def _pad_with_nan(values: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([values, values.new_full((size - values.numel(),), float("nan"))])


def _pad_with_false(values: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([values, values.new_zeros(size - values.numel())])

"""Drafts with another tokenizer than the target's: their scores reach the target's tokens through the text.

After Cross-Family Speculative Prefill (arXiv 2603.02631). The target's prompt (template rendered, tokenized as
the backend tokenizes it) is cut at the target's special tokens, the template's markup. Each text run between
them is decoded and tokenized with the draft's tokenizer, character offsets kept. Markup that the draft's
vocabulary also has, by name, goes to the draft as its own token. Other markup is left out of the draft's
input. It scores 0 but stays the target's and is kept anyway: ``select_tokens`` protects special tokens. The
draft's BOS opens its input if its tokenizer adds one.

The draft scores its tokens as always (pooled over its own tokens, max over layers and heads). Each target
token then takes the **maximum** score of the draft tokens whose character spans overlap its own. A target
token that no draft token overlaps (a span the draft's tokenizer skips, such as whitespace some tokenizers
drop) takes the maximum of the nearest draft token on each side. The target's selection runs on the result
as it does today. With one tokenizer on both sides every draft token is exactly one target token, and the
scores are exactly today's (``tests/gateway/test_token_mapping.py``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from common.blocks import Ints
from common.models import tokenizer_fingerprint
from common.tokenize import token_pieces
from draft_worker.config import ScoringConfig
from gateway.planning.draft import DraftClient

RULE = "max-overlap"  # how draft scores become target scores (part of every cache key of mapped scores)


@dataclass(slots=True)
class DraftInput:
    """A target prompt as the draft reads it, and which draft token scores which target token."""

    draft_ids: list[int]
    target_index: np.ndarray  # [P] pairs (target token, draft token) whose spans overlap
    draft_index: np.ndarray  # [P]
    n_target: int


class TokenMapping:
    """The mapping between one target tokenizer and one draft tokenizer (stateless; thread-safe)."""

    def __init__(self, target_tokenizer: PreTrainedTokenizerBase, draft_tokenizer: PreTrainedTokenizerBase) -> None:
        self.target = target_tokenizer
        self.draft = draft_tokenizer
        self.target_special = frozenset(target_tokenizer.all_special_ids) | frozenset(
            i for i, t in target_tokenizer.added_tokens_decoder.items() if t.special
        )
        draft_vocab = draft_tokenizer.get_vocab()
        self.passthrough = {
            i: draft_vocab[name]
            for i in self.target_special
            if (name := target_tokenizer.convert_ids_to_tokens(i)) in draft_vocab
        }
        probe = draft_tokenizer("a").input_ids
        bos = draft_tokenizer.bos_token_id
        self.draft_bos = bos if bos is not None and probe and probe[0] == bos else None
        self.identity = f"{RULE}:{tokenizer_fingerprint(target_tokenizer)}>{tokenizer_fingerprint(draft_tokenizer)}"

    def draft_input(self, target_ids: Sequence[int]) -> DraftInput:
        draft_ids: list[int] = []
        pairs_t: list[np.ndarray] = []
        pairs_d: list[np.ndarray] = []
        if self.draft_bos is not None and not (target_ids and self.passthrough.get(target_ids[0]) == self.draft_bos):
            draft_ids.append(self.draft_bos)
        start = 0
        n = len(target_ids)
        while start < n:
            if target_ids[start] in self.target_special:
                mapped = self.passthrough.get(target_ids[start])
                if mapped is not None:
                    pairs_t.append(np.array([start]))
                    pairs_d.append(np.array([len(draft_ids)]))
                    draft_ids.append(mapped)
                start += 1
                continue
            end = start
            while end < n and target_ids[end] not in self.target_special:
                end += 1
            t_pairs, d_pairs, ids = self._run(target_ids[start:end])
            pairs_t.append(t_pairs + start)
            pairs_d.append(d_pairs + len(draft_ids))
            draft_ids += ids
            start = end
        empty = np.zeros(0, dtype=np.int64)
        return DraftInput(
            draft_ids, np.concatenate(pairs_t) if pairs_t else empty, np.concatenate(pairs_d) if pairs_d else empty, n
        )

    def project(self, draft_scores: torch.Tensor, mapped: DraftInput) -> torch.Tensor:
        """Target scores [n_target]: the max over overlapping draft tokens; 0 where none maps (left-out markup)."""
        out = torch.zeros(mapped.n_target, dtype=draft_scores.dtype)
        if mapped.target_index.size:
            index = torch.from_numpy(mapped.target_index)
            values = draft_scores[torch.from_numpy(mapped.draft_index)]
            out.scatter_reduce_(0, index, values, reduce="amax", include_self=False)
        return out

    def _run(self, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """One run of target tokens without markup: the draft's tokens of its text, and the overlap pairs."""
        text, target_spans = self._target_text(ids)
        draft_ids, draft_spans = _encode(self.draft, text)
        return (*overlaps(target_spans, draft_spans), draft_ids)

    def _target_text(self, ids: Sequence[int]) -> tuple[str, np.ndarray]:
        """The run's text and each target token's character span in it: from the tokenizer's own offsets when
        decoding and re-tokenizing gives the same tokens, else from each token's decoded piece."""
        backend = getattr(self.target, "backend_tokenizer", None)
        text = str(
            backend.decode(list(ids), skip_special_tokens=False)
            if backend is not None
            else self.target.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )
        again, spans = _encode(self.target, text)
        if again == list(ids):
            return text, spans
        pieces = token_pieces(self.target, ids)
        ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
        return "".join(pieces), np.stack([ends - [len(p) for p in pieces], ends], axis=1)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[list[int], np.ndarray]:
    """Token IDs and character spans [N, 2], without special tokens (a fast tokenizer's own encoder directly:
    the wrapper's batching costs more than the encoding on long prompts)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encoded = backend.encode(text, add_special_tokens=False)
        return encoded.ids, np.array(encoded.offsets, dtype=np.int64).reshape(-1, 2)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded.input_ids), np.asarray(encoded.offset_mapping, dtype=np.int64).reshape(-1, 2)


def overlaps(target: np.ndarray, draft: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(target index, draft index) pairs of tokens whose character spans ``[start, end)`` overlap, both sorted
    by position; a target token with no overlap is paired with the nearest draft token on each side. Two equal
    segmentations pair token for token."""
    t_start, t_end = target[:, 0], target[:, 1]
    d_start, d_end = draft[:, 0], draft[:, 1]
    if len(draft) == 0 or len(target) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    if target.shape == draft.shape and bool((target == draft).all()):  # one segmentation: token for token (two
        index = np.arange(len(target), dtype=np.int64)  # byte tokens of one character share its span)
        return index, index
    sized = d_end > d_start
    # for each draft token, the target tokens [lo, hi) it overlaps: end past its start, start before its end
    order_end = np.maximum.accumulate(t_end)  # spans are sorted; the running max keeps searchsorted valid
    lo = np.searchsorted(order_end, d_start, side="right")
    hi = np.searchsorted(t_start, d_end, side="left")
    hi = np.where(sized, np.maximum(hi, lo), lo)
    counts = hi - lo
    d_index = np.repeat(np.arange(len(draft)), counts)
    t_index = np.repeat(lo, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts))
    keep = t_end[t_index] > t_start[t_index]  # zero-width target tokens overlap nothing
    t_index, d_index = t_index[keep], d_index[keep]
    covered = np.zeros(len(target), dtype=bool)
    covered[t_index] = True
    lonely = np.flatnonzero(~covered)
    if lonely.size:  # the nearest sized draft token before and after
        sized_index = np.flatnonzero(sized) if sized.any() else np.arange(len(draft))
        ends, starts = d_end[sized_index], d_start[sized_index]
        before = np.searchsorted(np.maximum.accumulate(ends), t_start[lonely], side="right") - 1
        after = np.searchsorted(starts, np.maximum(t_end[lonely], t_start[lonely]), side="left")
        extra_t, extra_d = [], []
        for side, valid in ((before, before >= 0), (after, after < len(sized_index))):
            extra_t.append(lonely[valid])
            extra_d.append(sized_index[side[valid]])
        t_index = np.concatenate([t_index, *extra_t])
        d_index = np.concatenate([d_index, *extra_d])
    return t_index.astype(np.int64), d_index.astype(np.int64)


class MappedDraft:
    """A draft client whose tokenizer differs from the target's: takes and answers target token IDs, as every
    draft client does, and sends the draft its own tokens (``TokenMapping``). Batching, remote workers, the
    draft's prefix reuse and the score cache work as with any draft: the cache key holds ``identity``, which
    names both tokenizers and the rule."""

    kind = "mapped"

    def __init__(
        self, inner: DraftClient, mapping: TokenMapping, on_mapped: Callable[[float], None] | None = None
    ) -> None:
        self.inner = inner
        self.mapping = mapping
        self.on_mapped = on_mapped  # called with the seconds each mapping took (a metric)
        self._recent: collections.OrderedDict[bytes, DraftInput] = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def config(self) -> ScoringConfig:
        return self.inner.config

    @property
    def score_params(self) -> tuple[int, ...]:
        return self.inner.score_params

    @property
    def max_prompt_tokens(self) -> int:
        return self.inner.max_prompt_tokens

    async def identity(self) -> str:
        return f"{await self.inner.identity()}|{self.mapping.identity}"

    async def score(self, token_ids: list[int]) -> torch.Tensor:
        mapped = await asyncio.to_thread(self._draft_input, token_ids)
        scores = await self.inner.score(mapped.draft_ids)
        return self.mapping.project(scores, mapped)

    def reusable_prefix(self, token_ids: Ints) -> int:
        """The draft's reusable prefix, in target tokens (its share of the draft's input, an estimate)."""
        mapped = self._draft_input(np.asarray(token_ids).tolist())  # the mapping walks a list
        reused = self.inner.reusable_prefix(mapped.draft_ids)
        return min(len(token_ids) - 1, len(token_ids) * reused // max(1, len(mapped.draft_ids)))

    async def ready(self) -> bool:
        return await self.inner.ready()

    async def close(self) -> None:
        await self.inner.close()

    def _draft_input(self, token_ids: list[int]) -> DraftInput:
        """Mapped once per prompt: the planner asks for the reusable prefix, then for the scores."""
        key = hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=16).digest()
        with self._lock:
            found = self._recent.get(key)
            if found is not None:
                self._recent.move_to_end(key)
                return found
        start = time.perf_counter()
        mapped = self.mapping.draft_input(token_ids)
        if self.on_mapped is not None:
            self.on_mapped(time.perf_counter() - start)
        with self._lock:
            self._recent[key] = mapped
            while len(self._recent) > 8:
                self._recent.popitem(last=False)
        return mapped

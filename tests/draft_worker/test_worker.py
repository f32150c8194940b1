from __future__ import annotations

import pytest
import torch

from draft_worker import DraftWorker, ScoringConfig
from draft_worker.loader import TokenizerMismatchError, check_same_tokenizer, load_tokenizer
from draft_worker.worker import PromptTooLongError
from specprefill.demo_models import train_tokenizer


def test_from_pretrained_loads_a_local_folder(model_pair):
    worker = DraftWorker.from_pretrained(model_pair / "draft", device="cpu")
    ids = worker.tokenizer("Bafu anbe zadubu ancuci focahe. " * 40).input_ids
    selection = worker.score_and_select(ids, 0.3)
    assert selection.original_tokens == len(ids)
    assert selection.kept_indices == sorted(selection.kept_indices)
    assert selection.kept_indices[0] == 0 and selection.kept_indices[-1] == len(ids) - 1  # protected ends


def test_same_tokenizer_passes_and_a_different_one_fails(model_pair, tokenizer):
    check_same_tokenizer(load_tokenizer(model_pair / "draft"), load_tokenizer(model_pair / "target"))
    with pytest.raises(TokenizerMismatchError, match="same tokenizer"):
        check_same_tokenizer(tokenizer, train_tokenizer(vocab_size=900))


def test_bad_prompts_raise_typed_errors(model_pair):
    worker = DraftWorker.from_pretrained(model_pair / "draft", ScoringConfig(look_ahead=2), device="cpu")
    with pytest.raises(ValueError, match="empty"):
        worker.score([])
    with pytest.raises(ValueError, match="token IDs"):
        worker.score([5, 10**6])
    with pytest.raises(PromptTooLongError):
        worker.score([5] * (worker.model.config.max_position_embeddings))


def test_extra_protected_tokens_are_kept(model_pair):
    worker = DraftWorker.from_pretrained(
        model_pair / "draft", ScoringConfig(chunk_size=1, protect_first=0, protect_last=0), device="cpu"
    )
    scores = torch.zeros(100)
    scores[50:] = 1.0
    assert worker.select(scores, 0.1, extra_protected=[3]).kept_indices == [3] + list(range(50, 59))

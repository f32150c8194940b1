from __future__ import annotations

import pytest
import torch

from common.models import TokenizerMismatchError, check_same_tokenizer, load_tokenizer
from common.selection import select_tokens
from draft_worker import DraftWorker, ScoringConfig
from draft_worker.worker import PromptTooLongError
from specprefill_lab.demo_models import train_tokenizer


def test_from_pretrained_loads_a_local_folder(model_pair):
    worker = DraftWorker.from_pretrained(model_pair / "draft", device="cpu")
    ids = worker.tokenizer("Bafu anbe zadubu ancuci focahe. " * 40).input_ids
    scores = worker.score(ids)
    assert scores.shape == (len(ids),) and scores.dtype == torch.float32
    kept = select_tokens(ids, scores, 0.3, worker.config)
    assert kept == sorted(kept) and len(kept) < 0.5 * len(ids)
    assert kept[0] == 0 and kept[-1] == len(ids) - 1  # protected ends


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


def test_special_tokens_and_the_last_token_are_always_kept():
    config = ScoringConfig(chunk_size=1, protect_first=0, protect_last=0)
    ids = [7] * 100
    ids[3] = 2  # a special token
    scores = torch.zeros(100)
    scores[50:60] = 1.0
    # budget 10: the special token and the last one (always sent) take two of them, the best scores the rest
    assert select_tokens(ids, scores, 0.1, config, special_ids={2}) == [3] + list(range(50, 58)) + [99]
    assert select_tokens(ids, scores, 0.1, config) == list(range(50, 59)) + [99]
    assert select_tokens(ids, scores, 1.0, config) == list(range(100))


def test_a_self_draft_is_the_model_cut_after_its_first_layers(model_pair, capsys):
    """``--draft-layers K``: the model's first K decoder layers, then its own final norm and head, as transformers
    builds the same checkpoint with a K-layer config; another identity (score-cache keys) than all the layers."""
    from transformers import AutoModelForCausalLM

    from specprefill.cli import main

    full = DraftWorker.from_pretrained(model_pair / "target", device="cpu")
    cut = DraftWorker.from_pretrained(model_pair / "target", device="cpu", layers=1)
    assert cut.model.config.num_hidden_layers == len(cut.model.get_decoder().layers) == 1
    assert cut.identity != full.identity
    reference = AutoModelForCausalLM.from_pretrained(model_pair / "target", num_hidden_layers=1).eval()
    ids = torch.tensor([cut.tokenizer("Bafu anbe zadubu ancuci focahe. " * 20).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(cut.model(ids).logits, reference(ids).logits)
    assert not torch.allclose(cut.score(ids[0].tolist()), full.score(ids[0].tolist()))
    with pytest.raises(ValueError, match="has 2 decoder layers; use 1 to 2"):
        DraftWorker.from_pretrained(model_pair / "target", device="cpu", layers=3)
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "serve",
                "--target-model",
                str(model_pair / "target"),
                "--draft-model",
                str(model_pair / "target"),
                "--draft-layers",
                "3",
            ]
        )
    assert exited.value.code == 2 and "--draft-layers 3" in capsys.readouterr().err

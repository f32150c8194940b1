"""Training the retrieval pair: batches point at the answers; the circuit losses reward exactly their patterns."""

from __future__ import annotations

import random

import torch

from specprefill_lab.retrieval import N_VALUES, make_bpe_tokenizer, make_tokenizer
from specprefill_lab.training import _training_batch, circuit_losses


def test_training_batches_point_at_the_answers():
    tokenizer = make_tokenizer()
    ids, rows, positions = _training_batch(random.Random(0), tokenizer, 4, 200)
    answers = ids[rows, positions]
    values = set(tokenizer.convert_tokens_to_ids([f"v{i}" for i in range(N_VALUES)]))
    assert all(int(a) in values for a in answers)
    keys = ids[rows, positions - 1]
    assert all(tokenizer.convert_ids_to_tokens(int(k)).startswith("k") for k in keys)


def test_circuit_losses_reward_exactly_the_previous_token_and_induction_patterns():
    ids = torch.tensor([[1, 7, 8, 9, 7, 8]])  # the second 7 should attend to the first 8 (position 2)
    length = ids.shape[1]
    previous_pattern = torch.zeros(1, length, length)
    previous_pattern[0, 0, 0] = 1
    previous_pattern[0, torch.arange(1, length), torch.arange(length - 1)] = 1
    induction_pattern = torch.full((1, length, length), 1e-12)
    induction_pattern[0, 4, 2] = 1  # 7 at 4 -> the token after the 7 at 1
    induction_pattern[0, 5, 3] = 1  # 8 at 5 -> the token after the 8 at 2
    previous, induction = circuit_losses(previous_pattern, induction_pattern, ids)
    assert previous.item() < 1e-6 and induction.item() < 1e-6
    shifted, wrong = circuit_losses(induction_pattern, previous_pattern, ids)
    assert shifted.item() > 10 and wrong.item() > 10


def test_training_batches_point_at_the_answers_with_another_tokenizer():
    """The SentencePiece-style BPE (``▁v12``: the space inside the token): answers found by character offsets,
    each followed by that tokenizer's own EOS."""
    tokenizer = make_bpe_tokenizer()
    ids, rows, positions = _training_batch(random.Random(0), tokenizer, 4, 200)
    answers = [tokenizer.convert_ids_to_tokens(int(a)) for a in ids[rows, positions]]
    assert all(a.startswith("▁v") and int(a[2:]) < N_VALUES for a in answers)
    assert all(tokenizer.convert_ids_to_tokens(int(k)).startswith("▁k") for k in ids[rows, positions - 1])
    assert (ids[rows, positions + 1] == tokenizer.eos_token_id).all()
    assert tokenizer("w3 k5 v7 .").input_ids[0] == tokenizer.bos_token_id

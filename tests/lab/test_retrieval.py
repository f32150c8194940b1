"""The synthetic retrieval task: every sample has exactly one answering record."""

from __future__ import annotations

import random

from specprefill_lab.retrieval import make_sample, make_tokenizer


def test_samples_hold_exactly_one_answering_record():
    tokenizer = make_tokenizer()
    sample = make_sample(random.Random(3), 600, 15)
    words = sample.text.split()
    key = words[-1]
    occurrences = [i for i, w in enumerate(words[:-1]) if w == key]
    assert len(occurrences) == 1 and words[occurrences[0] + 1] == sample.answer
    assert occurrences[0] - 3 == sample.needle_word
    ids = tokenizer(sample.text).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.pad_token_id not in ids
    assert len(ids) == len(words) + 1

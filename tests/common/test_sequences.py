import numpy as np
import pytest

from common.sequences import common_prefix, longest_prefix


def reference(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("part", [0, 1, 255, 256, 257, 1279, 1280, 5000, 12_000, None])
def test_common_prefix_matches_a_token_by_token_count_wherever_two_prompts_part(part):
    a = np.random.default_rng(0).integers(0, 50_000, 12_000)
    b = a.copy()
    if part is not None and part < b.size:
        b[part] += 1
    assert common_prefix(a, b) == reference(a, b) == (b.size if part is None else part)


def test_common_prefix_of_prompts_of_different_lengths():
    a = np.arange(3000)
    assert common_prefix(a, a[:2000]) == common_prefix(a[:2000], a) == 2000
    assert common_prefix(a, a[:0]) == 0


def test_longest_prefix_matches_a_full_comparison_of_every_candidate():
    """The quick rejection (a candidate that differs just past the best so far) never changes the answer:
    the first candidate with the longest shared prefix, as comparing each in full finds it."""
    rng = np.random.default_rng(1)
    head = rng.integers(0, 50, 3000)
    for trial in range(200):
        query = np.concatenate([head[: rng.integers(0, 3000)], rng.integers(0, 50, rng.integers(0, 40))])
        candidates = [
            (i, np.concatenate([head[: rng.integers(0, 3000)], rng.integers(0, 50, rng.integers(0, 40))]))
            for i in range(int(rng.integers(0, 8)))
        ]
        lengths = [reference(query, c) for _, c in candidates]
        expected = max(lengths, default=0)
        key = lengths.index(expected) if expected else None
        assert longest_prefix(query, candidates) == (key, expected), trial


def test_longest_prefix_compares_in_full_only_candidates_that_can_beat_the_best(monkeypatch):
    """Sixteen recent prompts that share one 12,000-token system prompt and then part: one full comparison,
    not sixteen (the point of the quick rejection)."""
    import common.sequences

    calls = []
    original = common.sequences.common_prefix
    monkeypatch.setattr(common.sequences, "common_prefix", lambda a, b: calls.append(1) or original(a, b))
    head = np.random.default_rng(2).integers(0, 50_000, 12_000)
    candidates = [(i, np.concatenate([head, [100_000 + i] * 20])) for i in range(16)]
    query = np.concatenate([head, [999_999] * 20])
    assert longest_prefix(query, candidates) == (0, 12_000)
    assert len(calls) == 1

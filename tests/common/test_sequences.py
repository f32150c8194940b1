import numpy as np
import pytest

from common.sequences import common_prefix


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

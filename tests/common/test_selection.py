from __future__ import annotations

import math
import random

import pytest
import torch

from common.selection import (
    AutoKeepRate,
    ConfigError,
    SelectionConfig,
    applied_keep_rate,
    fill_blocks,
    protected_mask,
    select_chunks,
    select_tokens,
    validate_keep_rate,
)
from draft_worker.config import ScoringConfig


def test_top_chunks_by_mean_score_sorted():
    scores = torch.tensor([0.0, 0.0, 5.0, 5.0, 1.0, 1.0, 9.0])  # chunks of 2: means 0, 5, 1, 9 (short last)
    assert select_chunks(scores, 0.5, 2).tolist() == [2, 3, 6]


def test_keep_rate_one_keeps_everything():
    assert select_chunks(torch.rand(77), 1.0, 32).tolist() == list(range(77))


def test_budget_is_the_exact_ceiling():
    # 10 chunks × 0.3 is 3.0000000000000004 in floats; the budget is 3 chunks, not 4
    assert select_chunks(torch.rand(10), 0.3, 1).numel() == 3
    assert select_chunks(torch.rand(11), 0.3, 1).numel() == 4


def test_protected_tokens_are_kept_one_by_one_and_spend_the_budget():
    scores = torch.tensor([0.0] * 8 + [9.0] * 2 + [0.0] * 10)  # 10 chunks of 2, chunk 4 scores highest
    protected = protected_mask(20, protect_first=1, protect_last=1)
    kept = select_chunks(scores, 0.3, 2, protected).tolist()
    # budget 3 chunks = 6 tokens: the two protected tokens, the best chunk (2), then chunk 0 (ties go to the
    # earlier chunk), which costs 1 as its first token is already kept, then chunk 1: 7 tokens, over by one
    assert kept == [0, 1, 2, 3, 8, 9, 19]


def test_protected_tokens_do_not_take_their_chunks():
    scores = torch.arange(100, dtype=torch.float).flip(0)  # the earlier the chunk, the better
    protected = protected_mask(100, protect_first=0, protect_last=12)  # the last 12 tokens: chunks 8 and 9
    kept = select_chunks(scores, 0.3, 10, protected).tolist()
    # 30 tokens: the 12 protected, then chunks 0 and 1 (18 + 20 >= 30); chunks 8 and 9 are not kept whole
    assert kept == list(range(20)) + list(range(88, 100))


def test_without_protection_the_top_chunks_exactly():
    """Against the paper's rule written plainly: chunk means, the top ceil(n_chunks × keep) of them."""
    scores = torch.rand(1000, generator=torch.Generator().manual_seed(0))  # 32 chunks, the last one short
    chunks = [scores[start : start + 32] for start in range(0, 1000, 32)]
    means = [chunk.mean().item() for chunk in chunks]
    for rate in (0.05, 0.1, 0.3, 0.7):
        top = sorted(sorted(range(len(chunks)), key=lambda c: -means[c])[: math.ceil(len(chunks) * rate)])
        expected = [i for c in top for i in range(32 * c, min(32 * c + 32, 1000))]
        assert select_chunks(scores, rate, 32).tolist() == expected
        assert select_chunks(scores, rate, 32, torch.zeros(1000, dtype=torch.bool)).tolist() == expected


@pytest.mark.parametrize("seed", range(20))
def test_kept_tokens_meet_the_budget_and_overshoot_by_less_than_a_chunk(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(1024, generator=generator)  # whole chunks: a short last one costs a whole one
    protected = torch.rand(1024, generator=generator) < 0.02
    for rate in (0.05, 0.1, 0.3):
        kept = select_chunks(scores, rate, 32, protected)
        budget = math.ceil(32 * rate) * 32
        assert budget <= len(kept) < budget + 32
        assert bool(torch.isin(protected.nonzero().squeeze(1), kept).all())


@pytest.mark.parametrize(
    ("length", "rate", "chunk"),
    [
        (2000, 0.3, 32),  # 19 chunks of 32: within 64
        (8000, 0.1, 32),  # 25
        (16003, 0.1, 32),  # 51
        (8003, 0.3, 64),  # 76 of 32, 38 of 64
        (16003, 0.3, 128),  # 151 of 32, 76 of 64, 38 of 128
        (32000, 0.1, 64),  # 100 of 32, 50 of 64
        (16003, 1.0, 32),  # the whole prompt: no chunks
    ],
)
def test_max_chunks_doubles_the_chunks_while_the_budget_buys_more(length, rate, chunk):
    config = SelectionConfig(max_chunks=64)
    assert config.chunk_for(length, rate) == chunk
    assert SelectionConfig().chunk_for(length, rate) == 32  # off by default: the paper's chunks


@pytest.mark.parametrize(
    ("length", "rate", "chunk"),
    [
        (2000, 0.1, 8),  # 7 chunks of 32, 13 of 16, 25 of 8
        (2000, 0.3, 32),  # 19 of 32: within 16 to 64
        (2000, 0.05, 4),  # 4, 7, 13, 25 of 4
        (8000, 0.1, 32),  # 25
        (16003, 0.1, 32),  # 51
        (16003, 0.3, 128),  # the cap above still doubles
        (40, 0.1, 1),  # 4 tokens of 40: single tokens, never below
        (2000, 1.0, 32),  # the whole prompt: no chunks
    ],
)
def test_min_chunks_halves_the_chunks_while_the_budget_buys_fewer(length, rate, chunk):
    config = SelectionConfig(min_chunks=16, max_chunks=64)
    assert config.chunk_for(length, rate) == chunk
    assert SelectionConfig(min_chunks=16).chunk_for(length, rate) == min(chunk, 32)


def test_a_floored_selection_is_the_plain_rule_in_the_shorter_chunks():
    scores = torch.rand(2000, generator=torch.Generator().manual_seed(2))
    config = SelectionConfig(min_chunks=16, protect_first=0, protect_last=0)
    kept = select_tokens(list(range(2000)), scores, 0.1, config)
    assert kept == select_chunks(scores, 0.1, 8, protected_mask(2000, 0, 1)).tolist()
    assert len(kept) == 201 and kept != select_tokens(  # 25 chunks of 8 and the last token
        list(range(2000)), scores, 0.1, SelectionConfig(protect_first=0, protect_last=0)
    )


def test_a_capped_selection_is_the_plain_rule_in_the_longer_chunks():
    """``select_tokens`` with ``max_chunks`` keeps what the plain rule keeps in chunks of the size it chose, and at
    most about ``max_chunks`` runs of them."""
    scores = torch.rand(8003, generator=torch.Generator().manual_seed(1))
    ids = list(range(8003))
    capped = SelectionConfig(max_chunks=48, protect_first=0, protect_last=0)
    kept = select_tokens(ids, scores, 0.3, capped)
    assert kept == select_chunks(scores, 0.3, 64, protected_mask(8003, 0, 1)).tolist()
    starts = [i for i in kept if i % 64 == 0]
    assert len(starts) <= 48 and all(i % 64 == 0 for i in starts)
    assert kept != select_tokens(ids, scores, 0.3, SelectionConfig(protect_first=0, protect_last=0))


def test_protection_wins_over_a_small_budget():
    protected = protected_mask(100, protect_first=10, protect_last=10)
    kept = select_chunks(torch.rand(100), 0.01, 1, protected).tolist()
    assert kept == list(range(10)) + list(range(90, 100))


def test_extra_protected_tokens():
    extra = torch.zeros(10, dtype=torch.bool)
    extra[[3, 7]] = True
    mask = protected_mask(10, 0, 0, extra)
    assert mask.nonzero().squeeze(1).tolist() == [3, 7]
    assert protected_mask(10, 0, 0) is None
    assert protected_mask(10, 0, 0, torch.zeros(10, dtype=torch.bool)) is None


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.01, float("nan"), float("inf")])
def test_bad_keep_rates(rate):
    with pytest.raises(ConfigError):
        validate_keep_rate(rate)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"look_ahead": 0},
        {"pool_kernel": 4},
        {"chunk_size": 0},
        {"protect_last": -1},
        {"propagate_layer": -1},
        {"propagate_rate": 0.0},
        {"propagate_rate": 1.5},
        {"max_chunks": -1},
        {"min_chunks": -1},
        {"min_chunks": 40, "max_chunks": 64},  # no chunk size need fit between them
    ],
)
def test_bad_scoring_config(kwargs):
    with pytest.raises(ConfigError):
        ScoringConfig(**kwargs)


def test_fill_blocks_completes_the_block_before_the_boundary_with_the_nearest_free_positions():
    kept = [0, 1, 2, 10, 11, 12, 13, 30, 31]  # 7 kept below 20
    assert fill_blocks(kept, 20, 4) == [0, 1, 2, 10, 11, 12, 13, 19, 30, 31]  # 8: two whole blocks of 4
    assert fill_blocks(kept, 20, 8) == kept[:7] + [19] + kept[7:]
    assert fill_blocks(kept, 20, 16) == sorted(kept + [14, 15, 16, 17, 18, 19, 9, 8, 7])  # walks back past kept ones
    assert fill_blocks(kept, 14, 4) == sorted(kept + [9])  # the nearest free position below 14 is 9
    assert fill_blocks([0, 1, 2, 3, 4], 5, 8) == [0, 1, 2, 3, 4]  # too few free below the boundary: unchanged
    assert fill_blocks(kept, 20, 1) == kept and fill_blocks(kept, 0, 16) == kept
    # never below ``floor`` (past what the engine holds): 14-19 are free there, too few for 16, so nothing
    assert fill_blocks(kept, 20, 16, floor=13) == kept
    assert fill_blocks(kept, 20, 8, floor=13) == fill_blocks(kept, 20, 8)
    rng = random.Random(0)
    for _ in range(200):
        kept = sorted(rng.sample(range(500), rng.randrange(1, 300)))
        boundary, block = rng.randrange(1, 500), rng.choice([2, 16, 128])
        floor = rng.randrange(0, boundary)
        filled = fill_blocks(kept, boundary, block, floor)
        below = sum(i < boundary for i in filled)
        assert set(kept) <= set(filled) and filled == sorted(set(filled))
        assert below % block == 0 or filled == kept
        assert len(filled) - len(kept) < block and all(floor <= i < boundary for i in set(filled) - set(kept))


# --- the auto keep rate: the fewest chunks holding the target share of the score mass ---


def _reference_auto_rate(scores: list[float], chunk: int, protected: set[int], target: float, floor, ceiling) -> float:
    """The rule written out plainly: chunk masses over the unprotected tokens, largest first, until the share."""
    n_chunks = math.ceil(len(scores) / chunk)
    masses = sorted(
        (sum(max(scores[i], 0.0) for i in range(c * chunk, min(len(scores), (c + 1) * chunk)) if i not in protected))
        for c in range(n_chunks)
    )[::-1]
    total, running, taken = sum(masses), 0.0, 0
    for mass in masses:
        taken += 1
        running += mass
        if running >= target * total * (1 - 1e-6):
            break
    rate = (taken * chunk + len(protected)) / (n_chunks * chunk)
    return min(ceiling, max(floor, rate))


@pytest.mark.parametrize("seed", range(5))
def test_the_auto_rate_is_the_plain_rule(seed):
    generator = random.Random(seed)
    length, chunk = generator.randrange(200, 3000), generator.choice([1, 8, 32])
    scores = [generator.random() ** 8 for _ in range(length)]  # peaked, as attention is
    protected = set(range(4)) | set(range(length - 32, length))
    mask = torch.zeros(length, dtype=torch.bool)
    mask[sorted(protected)] = True
    rule = AutoKeepRate(target=generator.choice([0.3, 0.5, 0.8]), floor=0.01, ceiling=1.0)
    got = rule.rate(torch.tensor(scores), chunk, mask)
    assert got == pytest.approx(_reference_auto_rate(scores, chunk, protected, rule.target, 0.01, 1.0))


def test_the_auto_rate_keeps_few_chunks_of_a_peaked_prompt_and_many_of_a_flat_one():
    rule = AutoKeepRate(target=0.5, floor=0.02, ceiling=0.5)
    peaked = torch.full((8000,), 1e-4)
    peaked[4000:4032] = 1.0  # one paragraph holds the mass
    assert rule.rate(peaked, 32) == pytest.approx(0.02)  # its chunk alone: 1/250 of them, raised to the floor
    assert rule.rate(torch.ones(8000), 32) == pytest.approx(0.5)  # half the chunks: at the ceiling
    assert rule.rate(torch.zeros(100), 32) == 0.5  # nothing to tell apart: as much as allowed
    tokens = list(range(8000))
    assert len(select_tokens(tokens, peaked, rule, ScoringConfig())) == len(
        select_tokens(tokens, peaked, applied_keep_rate(rule, tokens, peaked, ScoringConfig()), ScoringConfig())
    )


@pytest.mark.parametrize(
    ("fields", "says"),
    [({"target": 0.0}, "target must be"), ({"floor": 1.5}, "floor must be"), ({"floor": 0.5, "ceiling": 0.2}, "above")],
)
def test_bad_auto_rules(fields, says):
    with pytest.raises(ConfigError, match=says):
        AutoKeepRate(**fields)

"""The cost models' fit and the engine-cache model (in memory and in a real Redis)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gateway.engines.cache import MemoryEngineCache, RedisEngineCache
from gateway.planning.costs import _nonnegative_fit, cost_models


def test_the_fit_recovers_the_coefficients_and_never_goes_negative():
    target, _ = cost_models()
    truth = np.array([0.02, 4e-4, 5e-6, 2e-8])
    rng = np.random.default_rng(0)
    for new, cached in [(256, 0), (1024, 0), (2048, 0), (512, 2048), (64, 12000), (3000, 500), (32, 4000)]:
        seconds = float(truth @ [1, new, cached, new * (cached + new / 2)]) * rng.uniform(0.98, 1.02)
        target.observe(new, cached, seconds)
    np.testing.assert_allclose(target.coefficients, truth, rtol=0.2)
    flat, _ = cost_models()
    for new in (100, 1000, 4000, 8000):
        flat.observe(new, 0, 0.5)  # time that does not grow with size: a negative slope would fit best
    assert (flat.coefficients >= 0).all() and flat.predict(100, 0) == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ValueError, match="'draft': 4 numbers"):
        cost_models({"target": [1, 2, 3, 4], "draft": [1]})


def test_a_full_window_is_fitted_again_every_8th_answer_and_follows_a_change_of_speed(monkeypatch):
    """A fit per answer was a seventh of the gateway's CPU under load; one answer moves a 256-row fit by a 256th.
    The window's first answers are each fitted, then every n/32rd, and a lasting change of speed is still learnt."""
    target, _ = cost_models()
    fits = []
    refit = type(target).refit
    monkeypatch.setattr(type(target), "refit", lambda self: (fits.append(self._seen), refit(self))[1])
    truth = np.array([0.02, 4e-4, 5e-6, 2e-8])
    shapes = [(256, 0), (1024, 0), (64, 12000), (3000, 500), (32, 4000), (512, 2048)]
    for i in range(512):
        new, cached = shapes[i % len(shapes)]
        target.observe(new, cached, float(truth @ [1, new, cached, new * (cached + new / 2)]))
    assert fits[:63] == list(range(1, 64))  # each of the window's first 63 answers
    assert sum(1 for seen in fits if seen > 256) == 256 // 8  # a full window: every 8th
    np.testing.assert_allclose(target.coefficients, truth, rtol=0.05)
    for i in range(256 + 8):  # the engine doubles its time for good: learnt once the window holds only that
        new, cached = shapes[i % len(shapes)]
        target.observe(new, cached, 2 * float(truth @ [1, new, cached, new * (cached + new / 2)]))
    np.testing.assert_allclose(target.coefficients, 2 * truth, rtol=0.05)


def test_timings_a_fault_explains_leave_the_fit_as_it_was_and_a_lasting_change_is_learnt():
    """An engine stopped for a while (SIGSTOP, a hung GPU) answers requests sent into it 5-30x late, one at a
    time, so nothing flags them contended; an engine that serves from a cache it does not report answers 10x
    early. A minority of the window, they are left out (fitted in, a few fast ones price everything at a
    fraction of its cost). A slowdown that lasts becomes the majority and is learnt."""
    truth = np.array([0.02, 4e-4, 5e-6, 2e-8])
    rng = np.random.default_rng(0)
    shapes = [(8000, 0), (64, 12000), (500, 4000)]

    def seconds(coefficients, new: int, cached: int) -> float:
        return float(np.dot(coefficients, [1, new, cached, new * (cached + new / 2)]))

    def timings(count: int, slower: tuple[float, float]):
        for _ in range(count):
            new, cached = int(rng.integers(100, 4000)), int(rng.integers(0, 8000))
            yield new, cached, seconds(truth, new, cached) * rng.uniform(*slower)

    target, _ = cost_models()
    for timing in timings(120, (0.9, 1.1)):
        target.observe(*timing)
    for faulty in ((5, 30), (0.05, 0.2)):
        for timing in timings(10 if faulty[0] < 1 else 40, faulty):
            target.observe(*timing)
        for shape in shapes:
            assert target.predict(*shape) == pytest.approx(seconds(truth, *shape), rel=0.15)
    recent = min(target._seen, len(target._y))  # the same window fitted whole: what the rule keeps out
    whole = _nonnegative_fit(target._x[:recent] / target._y[:recent, None], np.ones(recent))
    assert seconds(whole, 8000, 0) < 0.5 * seconds(truth, 8000, 0)
    for timing in timings(200, (5.4, 6.6)):  # the engine is now 6x slower, for good
        target.observe(*timing)
    for shape in shapes:
        assert target.predict(*shape) == pytest.approx(6 * seconds(truth, *shape), rel=0.25)


async def test_the_memory_model_predicts_reusable_full_blocks_and_evicts_tails_first():
    model = MemoryEngineCache(block_size=16, capacity_tokens=64)
    first, second = list(range(100, 149)), list(range(300, 333))
    assert await model.cached_tokens(first, None) == 0
    await model.record(first, None)  # 3 full blocks
    assert await model.cached_tokens(first, None) == 48
    assert await model.cached_tokens(first[:48], None) == 32  # the last token is always computed
    assert await model.cached_tokens(first, list(range(49))) == 48  # default positions are default positions
    assert await model.cached_tokens(first, [p + 1 for p in range(49)]) == 0  # other positions, other blocks
    await model.record(second, None)  # 2 more: the first chain's tail goes
    assert await model.cached_tokens(first, None) == 32 and await model.cached_tokens(second, None) == 32


async def test_replicas_share_the_model_in_redis_and_an_outage_predicts_nothing(redis_url, caplog):
    key = "specprefill-test:engine-cache"
    a = RedisEngineCache(redis_url, key, 16, 1 << 16)
    b = RedisEngineCache(redis_url, key, 16, 1 << 16)
    await a.link.client.delete(key)
    prompt = list(range(1000, 1100))
    await a.record(prompt, None)
    assert await b.cached_tokens(prompt, None) == 96
    small = RedisEngineCache(redis_url, key, 16, 32)  # trimming keeps the newest blocks of the budget
    await small.record(list(range(5000, 5100)), None)
    assert await small.link.client.zcard(key) == 2
    await a.close(), await b.close(), await small.close()
    down = RedisEngineCache("redis://127.0.0.1:1/0", key, 16, 1 << 16, timeout=0.2)
    with caplog.at_level(logging.WARNING, logger="specprefill.gateway"):
        for _ in range(3):
            assert await down.cached_tokens(prompt, None) == 0
            await down.record(prompt, None)
    assert sum("Redis unavailable" in r.message for r in caplog.records) == 1
    await down.close()


async def test_a_connection_redis_dropped_is_replaced_without_an_outage(redis_url, caplog):
    """A pooled connection that broke while Redis stayed up (here Redis closes it; a request cancelled mid-command
    leaves one so) is replaced and the command retried at once: no outage, no warning."""
    import redis.asyncio as redis

    key = "specprefill-test:engine-cache-dropped"
    cache = RedisEngineCache(redis_url, key, 16, 1 << 16)
    prompt = list(range(2000, 2100))
    await cache.record(prompt, None)
    own_id = await cache.link.client.client_id()
    async with redis.Redis.from_url(redis_url) as admin:
        assert await admin.client_kill_filter(_id=own_id) == 1
    with caplog.at_level(logging.WARNING, logger="specprefill.gateway"):
        assert await cache.cached_tokens(prompt, None) == 96
    assert not any("Redis unavailable" in r.message for r in caplog.records)
    await cache.link.client.delete(key)
    await cache.close()


def test_the_block_hasher_reuses_chains_and_gives_exactly_the_block_hashes(monkeypatch):
    """Prompts that share a prefix, the same tokens at other positions, a shorter prompt, gapped positions:
    the hashes are always ``block_hashes``'s, and a prompt that begins like a recent one hashes only its tail."""
    import random

    import common.blocks
    from common.blocks import BlockHasher, block_hashes

    hashed: list[int] = []

    def counting(token_ids, *args, **kwargs):
        hashed.append(len(token_ids))
        return block_hashes(token_ids, *args, **kwargs)

    monkeypatch.setattr(common.blocks, "block_hashes", counting)

    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(1000)]
    gapped = sorted(rng.sample(range(5000), 1000))
    hasher = BlockHasher(16, capacity=4)
    cases = [
        (base, None),
        (base + [1, 2, 3] * 20, None),
        (base[:500], None),
        (base, gapped),
        (base[:900], gapped),
        (base[:300] + [7] * 700, None),
        (base, [p + 1 for p in range(1000)]),
        ([5] * 10, None),
    ]
    for tokens, positions in cases * 2:
        assert hasher(tokens, positions) == block_hashes(tokens, positions, 16)
    hasher(base, None)
    hashed.clear()
    hasher(base + [9] * 40, None)  # base (1,000 tokens: 62 full blocks) was hashed just before
    assert hashed == [1040 - 62 * 16]


def test_the_cost_coefficients_help_names_each_term_in_order():
    """--help and the generated reference say what the validator wants (they named 3 target terms of 4)."""
    from gateway.planning.costs import DRAFT_TERMS, TARGET_TERMS
    from gateway.settings import GatewaySettings

    help_text = GatewaySettings.model_fields["cost_coefficients"].description
    for name, terms in (("target", TARGET_TERMS), ("draft", DRAFT_TERMS)):
        assert f'"{name}": [{", ".join(terms)}]' in help_text


def _seconds(coefficients, new: int, cached: int) -> float:
    return float(np.dot(coefficients, [1, new, cached, new * (cached + new / 2)]))


def test_cold_prefills_priced_far_below_what_they_took_reset_a_fit_of_cached_contexts():
    """The case seen once: a window of cached contexts (a few hundred new tokens after 10,000), then the engine
    shares its hardware with another client's work and a cold 10,000-token prefill takes 40x its price, every
    45 s. The rule keeps each one out (the window's median speed does not explain it); from the third on, the
    fit starts again from them, and a cold prompt is priced at what it took."""
    truth = np.array([0.02, 4e-4, 5e-6, 2e-8])
    rng = np.random.default_rng(1)
    now = [0.0]
    target = cost_models()[0]
    target.clock = lambda: now[0]
    for _ in range(150):
        new, cached = int(rng.integers(50, 500)), int(rng.integers(8000, 12000))
        target.observe(new, cached, _seconds(truth, new, cached) * rng.uniform(0.9, 1.1))
    cold = 40 * _seconds(truth, 10_000, 0)
    for _ in range(2):
        now[0] += 45.0
        target.observe(10_000, 0, cold)
    assert target.predict(10_000, 0) < cold / 10 and target.resets == 0  # two: not yet
    now[0] += 45.0
    target.observe(10_000, 0, cold)
    assert target.resets == 1 and target.predict(10_000, 0) == pytest.approx(cold, rel=0.1)


def test_a_fit_wrong_for_good_is_reset_logged_and_counted(caplog):
    """Prefills the fit has evidence for, three in a row over more than a minute, each taking 20x its price (the
    engine shares its hardware with another client's work): the fit starts again from them. The same timings
    within seconds (an engine stopped for a moment) are waited out."""
    truth = np.array([0.02, 4e-4, 5e-6, 2e-8])
    rng = np.random.default_rng(2)
    now = [0.0]
    target = cost_models()[0]
    target.clock = lambda: now[0]
    shapes = [(int(rng.integers(600, 4000)), int(rng.integers(0, 8000))) for _ in range(200)]
    for new, cached in shapes[:120]:
        target.observe(new, cached, _seconds(truth, new, cached) * rng.uniform(0.9, 1.1))
    for new, cached in shapes[120:130]:  # a stall: 20x, all at once
        target.observe(new, cached, 20 * _seconds(truth, new, cached))
    assert target.resets == 0 and target.predict(2000, 0) == pytest.approx(_seconds(truth, 2000, 0), rel=0.2)
    with caplog.at_level(logging.WARNING, logger="specprefill.gateway"):
        for new, cached in shapes[130:133]:
            now[0] += 40.0
            target.observe(new, cached, 20 * _seconds(truth, new, cached))
    assert target.resets == 1 and "starts again" in caplog.text
    assert target.predict(2000, 1000) == pytest.approx(20 * _seconds(truth, 2000, 1000), rel=0.5)
    for new, cached in shapes[133:200]:  # and goes on learning at the new speed
        now[0] += 40.0
        target.observe(new, cached, 20 * _seconds(truth, new, cached) * rng.uniform(0.9, 1.1))
    assert target.predict(2000, 1000) == pytest.approx(20 * _seconds(truth, 2000, 1000), rel=0.2)
    assert target.resets == 1

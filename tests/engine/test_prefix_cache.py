"""The reference engine's prefix cache: answers identical with and without it, positions part of a block's
identity, LRU within the budget, and ``usage.prompt_tokens_details.cached_tokens`` as vLLM reports it."""

from __future__ import annotations

import pytest
import torch

from common.blocks import block_hashes, reusable_blocks
from common.models import load_causal_lm, load_tokenizer, with_cache
from engine.engine import ReferenceEngine
from engine.prefix_cache import PrefixCache
from engine.sampling import SamplingParams
from tests.helpers import engine_app, serve


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def target(model_pair):
    return load_causal_lm(model_pair / "target", device="cpu")


@pytest.fixture(scope="module")
def target_tokenizer(model_pair):
    return load_tokenizer(model_pair / "target")


async def _run(engine: ReferenceEngine, ids: list[int], positions: list[int], n: int = 8):
    params = SamplingParams(max_tokens=n, temperature=0, logprobs=5, ignore_eos=True)
    steps = [s async for s in engine.generate(ids, positions, params)]
    return (
        [s.token_id for s in steps],
        [s.logprob for s in steps],
        [s.top_logprobs for s in steps],
        steps[-1].cached_tokens,
    )


def _close(a: list[dict[int, float]], b: list[dict[int, float]], tol: float = 1e-5) -> bool:
    return all(x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) <= tol for x, y in zip(a, b))


def test_block_hashes_chain_tokens_and_positions():
    ids = list(range(100, 140))
    plain = block_hashes(ids, None, 16)
    assert len(plain) == 2 and plain == block_hashes(ids, list(range(40)), 16)  # default positions
    moved = block_hashes(ids, list(range(16)) + list(range(50, 74)), 16)
    assert moved[0] == plain[0] and moved[1] != plain[1]  # a block before the first gap is shared
    other_head = block_hashes([7] + ids[1:], None, 16)
    assert other_head[1] != plain[1]  # a block's identity includes everything before it
    assert reusable_blocks(2, 32, 16) == 1 and reusable_blocks(2, 33, 16) == 2  # the last token is always computed


async def test_answers_are_identical_with_and_without_the_cache(target, target_tokenizer):
    cached = ReferenceEngine(target, target_tokenizer, prefix_cache=PrefixCache(4096, block_size=16))
    plain = ReferenceEngine(target, target_tokenizer)
    try:
        doc = _prompt(300, seed=1)
        gapped = list(range(0, 64)) + list(range(100, 180)) + list(range(250, 300))
        cases = [
            (doc, list(range(300)), 0),  # cold
            (doc + _prompt(20, seed=2), list(range(320)), 288),  # the same document, a new question: 18 blocks hit
            ([doc[p] for p in gapped], gapped, 64),  # kept tokens at gapped positions: only the 4 default blocks
            ([doc[p] for p in gapped], gapped, 192),  # and again: every full block at these positions
            (doc, list(range(300)), 288),
        ]
        for ids, positions, expected_cached in cases:
            tokens, logprobs, tops, n_cached = await _run(cached, ids, positions)
            reference = await _run(plain, ids, positions)
            assert n_cached == expected_cached
            assert tokens == reference[0]
            assert max(abs(a - b) for a, b in zip(logprobs, reference[1])) <= 1e-5
            assert _close(tops, reference[2])
    finally:
        cached.close()
        plain.close()


async def test_a_finished_sequence_leaves_its_generated_tokens_behind(target, target_tokenizer):
    """A chat's next turn reads the previous answer from the cache, as on vLLM."""
    engine = ReferenceEngine(target, target_tokenizer, prefix_cache=PrefixCache(4096, block_size=16))
    try:
        prompt = _prompt(40, seed=3)
        tokens, *_ = await _run(engine, prompt, list(range(40)), n=30)
        turn = prompt + tokens + _prompt(5, seed=4)
        *_, n_cached = await _run(engine, turn, list(range(len(turn))), n=1)
        assert n_cached == 64  # 40 prompt + 29 fed answer tokens = 69 computed: 4 full blocks
    finally:
        engine.close()


def test_lru_within_the_budget_evicts_tails_first(target, target_tokenizer):
    cache = PrefixCache(max_tokens=64, block_size=16)  # 4 blocks
    from transformers import DynamicCache

    def computed(ids):
        kv = DynamicCache(config=target.config)
        with torch.inference_mode():
            target(input_ids=torch.tensor([ids]), **with_cache(target, kv), use_cache=True)
        return kv

    first, second = _prompt(49, seed=5), _prompt(33, seed=6)
    cache.store(first, list(range(49)), computed(first))  # 3 blocks
    cache.store(second, list(range(33)), computed(second))  # 2 more: one of first's goes, its tail
    assert cache.cached_tokens == 64
    assert cache.lookup(first, list(range(49)), target.config)[1] == 32
    # that lookup made room for the block first will compute, as vLLM allocates before computing: second's
    # tail went, the least recently used
    assert cache.lookup(second, list(range(33)), target.config)[1] == 16
    off = PrefixCache(max_tokens=0, block_size=16)
    off.store(first, list(range(49)), computed(first))
    assert off.cached_tokens == 0 and off.lookup(first, list(range(49)), target.config) == (None, 0)


def test_usage_reports_cached_tokens_over_http(model_pair):
    import httpx

    with serve(engine_app(model_pair, block_size=16)) as url:
        body = {"prompt": _prompt(100, seed=7), "max_tokens": 1, "temperature": 0}
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
        second = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["prompt_tokens_details"] == {"cached_tokens": 96}
        off = engine_app(model_pair, kv_cache_tokens=0)
    with serve(off) as url:
        for _ in range(2):
            usage = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": 0}

"""Draft prefix reuse: a prompt extending a recent one prefills only its suffix, with the same scores."""

from __future__ import annotations

import torch

from draft_worker import DraftWorker, ScoringConfig
from draft_worker.capture import enable_query_capture
from draft_worker.prefix_cache import PrefixKVCache
from draft_worker.scorer import PromptKV, score_prompts
from tests.helpers import tiny_llama


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _workers(config: ScoringConfig | None = None):
    model = tiny_llama(seed=11)
    reuse = DraftWorker(model, None, config, prefix_cache_bytes=1 << 26)
    scratch = DraftWorker(model, None, config, prefix_cache_bytes=0)
    return reuse, scratch


def test_document_then_new_questions():
    reuse, scratch = _workers()
    document = _ids(900, 1)
    for question_seed in (2, 3, 4):
        prompt = document + _ids(40, question_seed)
        torch.testing.assert_close(reuse.score(prompt), scratch.score(prompt), rtol=1e-5, atol=1e-8)
    assert reuse.prefix_cache.hits == 2 and reuse.prefix_cache.misses == 1


def test_three_turn_chat():
    reuse, scratch = _workers()
    history: list[int] = []
    for turn in range(3):
        history = history + _ids(300, 10 + turn)  # the next user message
        torch.testing.assert_close(reuse.score(history), scratch.score(history), rtol=1e-5, atol=1e-8)
        history = history + _ids(50, 20 + turn)  # the assistant's answer, sent back next turn
    assert reuse.prefix_cache.hits == 2


def test_the_same_prompt_again_recomputes_only_its_last_token():
    reuse, scratch = _workers()
    prompt = _ids(500, 5)
    first = reuse.score(prompt)
    entry, reused = reuse.prefix_cache.lookup(prompt)
    assert reused == len(prompt) - 1
    torch.testing.assert_close(reuse.score(prompt), first, rtol=1e-5, atol=1e-8)


def test_an_observation_window_is_always_prefilled():
    """With a window of 16, a prompt that adds 4 tokens to a cached one still prefills its last 16: its scores
    are the ones made from scratch."""
    reuse, scratch = _workers(ScoringConfig(observation_window=16))
    prompt = _ids(500, 5)
    reuse.score(prompt)
    longer = prompt + _ids(4, 6)
    assert reuse.prefix_cache.lookup(longer)[1] == len(longer) - 16
    torch.testing.assert_close(reuse.score(longer), scratch.score(longer), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(reuse.score(prompt), scratch.score(prompt), rtol=1e-5, atol=1e-8)


def test_local_attention_reads_a_suffix_as_it_reads_the_whole():
    """With local attention the suffix after a cached prefix sees what it would have seen read at once (blocks
    aligned to absolute positions): the same scores as from scratch, the prefix 700 tokens, a block boundary
    inside the suffix."""
    reuse, scratch = _workers(ScoringConfig(local_attention=64, observation_window=16))
    document = _ids(700, 7)
    reuse.score(document)
    prompt = document + _ids(600, 8)
    assert reuse.prefix_cache.lookup(prompt)[1] > 0
    torch.testing.assert_close(reuse.score(prompt), scratch.score(prompt), rtol=1e-5, atol=1e-8)


def test_a_propagating_draft_reads_every_prompt_whole():
    """With token-selective propagation a prompt's upper layers hold the tokens its own window chose, so no draft
    prefix is kept or reused: a document asked again with a new question scores as from scratch."""
    reuse, scratch = _workers(ScoringConfig(propagate_layer=1, propagate_rate=0.2, observation_window=8))
    assert reuse.prefix_cache is None
    document = _ids(600, 3)
    for question_seed in (4, 5):
        prompt = document + _ids(30, question_seed)
        torch.testing.assert_close(reuse.score(prompt), scratch.score(prompt), rtol=1e-5, atol=1e-8)


def test_batched_runs_store_unpadded_entries():
    model = tiny_llama(seed=12)
    enable_query_capture(model)
    prompts = [_ids(200, 1), _ids(350, 2)]
    _, kvs = score_prompts(model, prompts, ScoringConfig(), return_kv=True)
    for prompt, kv in zip(prompts, kvs):
        assert kv.token_ids.tolist() == prompt and kv.layers[0][0].shape[2] == len(prompt)
        extended = prompt + _ids(30, 9)
        (with_prefix,), _ = score_prompts(model, [extended], ScoringConfig(), prefix=kv, prefix_len=len(prompt))
        (alone,), _ = score_prompts(model, [extended], ScoringConfig())
        torch.testing.assert_close(with_prefix, alone, rtol=1e-5, atol=1e-8)


def _kv(n: int, start: int = 0) -> PromptKV:
    return PromptKV(torch.arange(start, start + n), [(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4))])


def test_lru_is_bounded_by_bytes_and_short_prefixes_do_not_count():
    cache = PrefixKVCache(max_bytes=_kv(100).nbytes * 2 + 1, min_prefix=64)
    for start in (0, 1000, 2000):  # three unrelated prompts; two fit
        cache.store(_kv(100, start))
    assert cache.nbytes <= cache.max_bytes and len(cache._entries) == 2
    assert cache.lookup(list(range(100)) + [7]) is None  # the oldest was evicted
    assert cache.lookup(list(range(1000, 1100)) + [7])[1] == 100
    assert cache.lookup(list(range(1000, 1010)) + [999] * 100) is None  # a 10-token prefix does not count


def test_a_prompt_that_extends_an_entry_replaces_it():
    cache = PrefixKVCache(max_bytes=1 << 20)
    cache.store(_kv(100))
    cache.store(_kv(100, 5000))  # unrelated: stays
    cache.store(_kv(150))  # begins with the first entry's prompt: that one is redundant now
    assert sorted(e.token_ids.numel() for e in cache._entries.values()) == [100, 150]
    assert cache.nbytes == _kv(100).nbytes + _kv(150).nbytes
    assert cache.lookup(list(range(120)) + [7])[1] == 120

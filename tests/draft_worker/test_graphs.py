"""The look-ahead over static buffers (what a CUDA graph replays) scores as the plain steps do.

On the CPU the static-buffer steps run without capture; on a GPU the last test captures and replays real
CUDA graphs (it runs where a GPU is, as on the project's lent GPU machine; CI has none).
"""

from __future__ import annotations

import pytest
import torch

from draft_worker.capture import enable_query_capture
from draft_worker.config import ScoringConfig
from draft_worker.graphs import MIN_BUCKET, QUERY_SLOTS, LookAheadGraphs, _bucket
from draft_worker.scorer import score_prompts
from draft_worker.worker import DraftWorker
from tests.helpers import tiny_llama


def _prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_buckets_round_up_by_an_eighth_of_a_power_of_two():
    assert _bucket(1) == MIN_BUCKET and _bucket(MIN_BUCKET) == MIN_BUCKET
    assert _bucket(32768 + 8) == 36864  # not 65536: a prompt just past a power of two reads 1/8 more keys
    assert all(n <= _bucket(n) <= n * 1.125 for n in range(8192, 70000, 997))


@pytest.mark.parametrize("look_ahead", [1, 2, 8, QUERY_SLOTS + 1, QUERY_SLOTS + 2])  # the last: plain steps
def test_static_steps_score_as_the_plain_steps(look_ahead):
    model = tiny_llama(seed=5, max_positions=4096)
    enable_query_capture(model)
    config = ScoringConfig(look_ahead=look_ahead)
    graphs = LookAheadGraphs(model)
    # lengths that share a bucket, cross into a larger one (the buffers grow) and come back to a small one
    for length, seed in [(40, 0), (300, 1), (1200, 2), (700, 3), (1200, 4)]:
        prompt = _prompt(length, seed)
        (plain,), _ = score_prompts(model, [prompt], config)
        (static,), _ = score_prompts(model, [prompt], config, graphs=graphs)
        torch.testing.assert_close(static, plain, rtol=1e-5, atol=1e-7)
    assert graphs.capacity == _bucket(1200 + look_ahead)


def test_static_steps_after_a_reused_prefix_and_eos():
    model = tiny_llama(seed=3, max_positions=4096, eos=[5, 7, 11])  # greedy tokens hit EOS now and then
    enable_query_capture(model)
    config = ScoringConfig()
    graphs = LookAheadGraphs(model)
    prompt = _prompt(900, 8)
    _, (kv,) = score_prompts(model, [prompt[:600]], config, return_kv=True, graphs=graphs)
    (plain,), _ = score_prompts(model, [prompt], config)
    (static,), _ = score_prompts(model, [prompt], config, prefix=kv, prefix_len=600, graphs=graphs)
    torch.testing.assert_close(static, plain, rtol=1e-5, atol=1e-7)


def test_kept_prefixes_are_copies_of_the_static_buffers():
    """The draft's prefix cache keeps a prompt's KV; the next prompt overwrites the static buffers."""
    model = tiny_llama(seed=9, max_positions=4096)
    worker = DraftWorker(model, None, ScoringConfig())
    worker.graphs = LookAheadGraphs(worker.model)
    first, other = _prompt(800, 1), _prompt(800, 2)
    worker.score(first)
    worker.score(other)  # writes the buffers the first prompt's KV was made in
    extended = first + _prompt(64, 3)
    reused = worker.score(extended)
    assert worker.prefix_cache.hits >= 1
    (plain,), _ = score_prompts(model, [extended], worker.config)
    torch.testing.assert_close(reused, plain, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_score_as_the_plain_steps(dtype):
    model = tiny_llama(seed=5, max_positions=8192, hidden=256, heads=8, kv_heads=2).to("cuda", dtype)
    enable_query_capture(model)
    config = ScoringConfig()
    graphs = LookAheadGraphs(model)
    for length, seed in [(500, 0), (3000, 1), (5000, 2), (3000, 3)]:
        prompt = _prompt(length, seed)
        (plain,), _ = score_prompts(model, [prompt], config)
        (graphed,), _ = score_prompts(model, [prompt], config, graphs=graphs)
        assert graphs.enabled, "capture failed"
        assert torch.isfinite(graphed).all()
        if dtype == torch.float32:
            torch.testing.assert_close(graphed, plain, rtol=1e-4, atol=1e-6)
        else:  # bf16 rounding may flip a near-tie among the random model's greedy tokens: scores stay close
            assert torch.nn.functional.cosine_similarity(graphed, plain, dim=0) > 0.98

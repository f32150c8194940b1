"""The in-place KV cache: the same logits as transformers' own cache, step by step, and no copy per step."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from common.kv_cache import AppendLayer, append_cache
from common.models import with_cache
from tests.helpers import tiny_llama


def _run(model, cache, prompt: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """A prefill, then greedy steps one token each; every forward's logits."""
    out = model(input_ids=prompt, **with_cache(model, cache), use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(input_ids=token, **with_cache(model, cache), use_cache=True).logits[:, -1])
    return logits


@torch.inference_mode()
def test_append_cache_reads_as_transformers_cache_does():
    model = tiny_llama(seed=4)
    prompt = torch.randint(3, 250, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = _run(model, DynamicCache(config=model.config), prompt, steps=6)
    for capacity, reserve in ((46, 0), (0, 2), (10, 1)):  # room for all; grown every other step; grown each step
        cache = append_cache(model.config, capacity, reserve=reserve)
        assert all(isinstance(layer, AppendLayer) for layer in cache.layers)
        got = _run(model, cache, prompt, steps=6)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert cache.get_seq_length() == 46


@torch.inference_mode()
def test_a_cache_given_layers_continues_from_them_and_appends_in_place():
    model = tiny_llama(seed=5)
    prompt = torch.randint(3, 250, (1, 30), generator=torch.Generator().manual_seed(1))
    full = DynamicCache(config=model.config)
    model(input_ids=prompt[:, :20], **with_cache(model, full), use_cache=True)
    layers = [(layer.keys.clone(), layer.values.clone()) for layer in full.layers]
    expected = _run(model, full, prompt[:, 20:], steps=3)

    cache = append_cache(model.config, 40, layers=layers)
    buffers = [layer.keys.untyped_storage().data_ptr() for layer in cache.layers]
    got = _run(model, cache, prompt[:, 20:], steps=3)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the keys handed out are views of the first buffer: no forward copied the cache
    assert [layer.keys.untyped_storage().data_ptr() for layer in cache.layers] == buffers
    assert layers[0][0].data_ptr() != cache.layers[0].keys.data_ptr()  # the given layers were copied, not aliased


def test_the_cache_goes_by_the_keyword_the_forward_takes():
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; either release's models get theirs."""

    class Before(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class After(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None): ...

    cache = object()
    assert with_cache(Before(), cache) == {"past_key_values": cache}
    assert with_cache(After(), cache) == {"cache": cache}

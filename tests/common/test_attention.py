import copy

import torch

from common.attention import GQA_SDPA, use_gqa_sdpa
from engine.runner import prefill
from tests.helpers import reference_logits, tiny_llama


def test_grouped_query_attention_by_the_kernel_matches_the_oracle_on_a_cached_prefix_at_gapped_positions(
        monkeypatch):
    model = tiny_llama(heads=4, kv_heads=2)
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == GQA_SDPA
    grouped = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        grouped.append(kwargs.get("enable_gqa", False))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (60,), generator=generator).tolist()
    positions = sorted(torch.randperm(500, generator=generator)[:60].tolist())
    _, cache = prefill(model, torch.tensor([ids[:40]]), torch.tensor([positions[:40]]))
    logits, _ = prefill(model, torch.tensor([ids[40:]]), torch.tensor([positions[40:]]), cache)
    # the second chunk has a mask (a cached prefix before it): the kernel's own GQA, no copies of the cache
    assert grouped[-model.config.num_hidden_layers:] == [True] * model.config.num_hidden_layers
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    torch.testing.assert_close(logits, reference_logits(eager, ids, positions), atol=1e-4, rtol=1e-4)


def test_models_on_other_kernels_are_left_alone():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == "eager"

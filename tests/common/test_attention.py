import copy

import pytest
import torch

from common.attention import GQA_SDPA, decode_attention, float_logits, use_gqa_sdpa
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


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_the_fused_kernel(kind, dtype):
    """One query position, grouped heads, a mask hiding the cache's tail: as SDPA computes it (CUDA uses this)."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 8, 1, 64, generator=g).to(dtype)
    key, value = (torch.randn(2, 2, 300, 64, generator=g).to(dtype) for _ in range(2))
    visible = torch.arange(300) < torch.tensor([[250], [300]])  # [2, 300]: row 0 sees 250 keys
    mask = visible[:, None, None, :]
    if kind == "additive":
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=visible[:, None, None, :], enable_gqa=True
    ).transpose(1, 2)
    got = decode_attention(query, key, value, mask, scaling=64**-0.5)
    assert got.shape == (2, 1, 8, 64) and got.dtype == dtype
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), expected, **tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float_logits_on_cuda_are_the_upcast_products(dtype):
    """Half-precision operands with float32 products, as upcasting both first would give (grouped heads, a
    key buffer read through a slice, as the look-ahead's static cache hands it)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    queries = torch.randn(1, 8, 4, 64, device="cuda", generator=g).to(dtype)
    buffer = torch.randn(1, 8, 1000, 64, device="cuda", generator=g).to(dtype)
    keys = buffer[:, :, :700]
    got = float_logits(queries, keys)
    assert got.dtype == torch.float32 and got.shape == (1, 8, 4, 700)
    torch.testing.assert_close(got, queries.float() @ keys.float().transpose(-1, -2), rtol=1e-5, atol=1e-4)

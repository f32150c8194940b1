import copy

import pytest
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from common import attention
from common.attention import (
    GQA_SDPA,
    decode_attention,
    end_aligned_causal_mask,
    float_logits,
    lower_right_causal_attention,
    use_gqa_sdpa,
)
from engine.runner import prefill
from tests.helpers import reference_logits, tiny_llama


def test_grouped_query_attention_by_the_kernel_matches_the_oracle_on_a_cached_prefix_at_gapped_positions(monkeypatch):
    model = tiny_llama(heads=4, kv_heads=2)
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == GQA_SDPA
    grouped = []
    split = attention.split_causal_attention

    def spy(query, key, value, scaling=None):
        grouped.append(query.shape[1] != key.shape[1])  # the kernel's own GQA: the cache is not copied per head
        return split(query, key, value, scaling)

    monkeypatch.setattr(attention, "split_causal_attention", spy)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (60,), generator=generator).tolist()
    positions = sorted(torch.randperm(500, generator=generator)[:60].tolist())
    _, cache = prefill(model, torch.tensor([ids[:40]]), torch.tensor([positions[:40]]))
    logits, _ = prefill(model, torch.tensor([ids[40:]]), torch.tensor([positions[40:]]), cache)
    # the second chunk follows a cached prefix: causal at the keys' end, two flash calls on the CPU, the kernel's own
    # GQA (no copies of the cache)
    assert grouped[-model.config.num_hidden_layers :] == [True] * model.config.num_hidden_layers
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


def _mask_arguments(q_length: int, kv_length: int, padding: torch.Tensor | None, device: str) -> dict:
    return {
        "batch_size": 1,
        "q_length": q_length,
        "kv_length": kv_length,
        "q_offset": kv_length - q_length,
        "kv_offset": 0,
        "attention_mask": padding,
        "allow_is_causal_skip": True,
        "device": device,
        "dtype": torch.float32,
    }


def test_a_chunk_at_the_end_of_its_cache_gets_no_mask(monkeypatch):
    """Left out (None), the attention runs the lower-right causal kernel (CUDA) or the split one (CPU); padding, a
    chunk not at the end of the keys or another device keep transformers' own mask."""
    made = []
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

    def spy(**kwargs):
        made.append(kwargs["device"])
        return sdpa_mask(**{**kwargs, "device": "cpu"})

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS, "sdpa", spy)
    ones = torch.ones(1, 300, dtype=torch.long)
    assert end_aligned_causal_mask(**_mask_arguments(100, 300, ones, "cuda")) is None
    assert end_aligned_causal_mask(**_mask_arguments(100, 300, None, "cuda")) is None
    assert end_aligned_causal_mask(**_mask_arguments(100, 300, ones, "cpu")) is None
    assert made == []
    padded = ones.clone()
    padded[0, 5] = 0
    cases = [
        _mask_arguments(100, 300, padded, "cuda"),
        _mask_arguments(100, 300, ones, "meta"),
        {**_mask_arguments(100, 300, ones, "cuda"), "q_offset": 0},  # not at the end: a static cache's room
        {**_mask_arguments(100, 300, ones, "cuda"), "local_size": 64},
    ]
    for arguments in cases:
        mask = end_aligned_causal_mask(**arguments)
        assert mask is not None and mask.shape[-2:] == (100, 300)
    assert made == ["cuda", "meta", "cuda", "cuda"]


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_lower_right_causal_attention_is_attention_under_the_end_aligned_mask(kv_heads):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 40, 32, generator=g)
    key, value = (torch.randn(1, kv_heads, 100, 32, generator=g) for _ in range(2))
    visible = torch.arange(100)[None, :] <= torch.arange(60, 100)[:, None]  # query i sees keys 0..60+i
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, enable_gqa=kv_heads != 8
    ).transpose(1, 2)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 8 // kv_heads, True
    torch.testing.assert_close(lower_right_causal_attention(module, query, key, value), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_prefill_on_cuda_runs_the_flash_kernel_and_matches_the_oracle(monkeypatch):
    """Kept tokens at gapped positions, in three chunks on a bf16 model: every chunk after the first without a
    mask, through SDPA's lower-right causal form, and the logits as an explicit-mask float32 forward gives."""
    model = tiny_llama(hidden=256, heads=8, kv_heads=2, max_positions=8192).to("cuda", torch.bfloat16)
    use_gqa_sdpa(model)
    flash = []
    lower_right = attention.lower_right_causal_attention

    def spy(module, query, key, value, scaling=None):  # (SDPA itself cannot be wrapped: CausalBias dispatches on it)
        params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, False, True)
        flash.append(torch.backends.cuda.can_use_flash_attention(params))
        return lower_right(module, query, key, value, scaling)

    monkeypatch.setattr(attention, "lower_right_causal_attention", spy)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 256, (1500,), generator=generator).tolist()
    positions = sorted(torch.randperm(6000, generator=generator)[:1500].tolist())
    _, cache = prefill(model, torch.tensor([ids[:600]], device="cuda"), torch.tensor([positions[:600]], device="cuda"))
    prefill(
        model, torch.tensor([ids[600:1200]], device="cuda"), torch.tensor([positions[600:1200]], device="cuda"), cache
    )
    logits, _ = prefill(
        model, torch.tensor([ids[1200:]], device="cuda"), torch.tensor([positions[1200:]], device="cuda"), cache
    )
    assert flash == [True] * 2 * model.config.num_hidden_layers, flash
    eager = copy.deepcopy(model).float()
    eager.set_attn_implementation("eager")
    expected = reference_logits(eager.cpu(), ids, positions)
    assert torch.nn.functional.cosine_similarity(logits.cpu(), expected, dim=0) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_after_a_cache_split_in_two_is_the_masked_attention(dtype):
    """The last 40 of 300 positions, grouped heads: the cached keys whole, the chunk's own causally, merged."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 8, 40, 32, generator=g).to(dtype)
    key, value = (torch.randn(2, 2, 300, 32, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(40, 300, dtype=torch.bool).tril(260)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    got = attention.split_causal_attention(query, key, value)
    assert got.shape == (2, 40, 8, 32) and got.dtype == dtype
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("queries", "keys", "window", "block"),
    [(300, 300, 64, 32), (100, 300, 64, 32), (77, 300, 40, 16), (300, 300, 1000, 32), (1, 300, 64, 32)],
    ids=["cold", "after-a-cache", "unaligned-chunk", "window-past-the-prompt", "one-query"],
)
def test_local_causal_attention_is_attention_under_its_explicit_mask(dtype, queries, keys, window, block):
    """Query i (the last Q of K) sees the first ATTENTION_SINKS keys and those from ``window`` before its block
    (blocks aligned to absolute positions) up to its own: against one SDPA call under that [Q, K] mask."""
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, 6, queries, 16, generator=g).to(dtype)
    key, value = (torch.randn(1, 2, keys, 16, generator=g).to(dtype) for _ in range(2))
    rows = torch.arange(keys - queries, keys)[:, None]
    columns = torch.arange(keys)[None, :]
    mask = (columns <= rows) & ((columns < attention.ATTENTION_SINKS) | (columns >= (rows // block) * block - window))
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    got = attention.local_causal_attention(query, key, value, window, block=block)
    assert got.shape == (1, queries, 6, 16) and got.dtype == dtype
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), expected, **tolerance)

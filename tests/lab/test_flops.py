"""The FLOP count of ``specprefill_lab.flops`` against PyTorch's own count of a real forward (a tiny Qwen2 with
random weights): its linear maps and its head exactly; attention as the causal half of what eager attention
multiplies (the whole square)."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from common.models import with_cache
from specprefill_lab.flops import SHAPES, Shape, shares


def _tiny() -> tuple[Qwen2ForCausalLM, Shape]:
    config = Qwen2Config(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(config).eval()
    return model, Shape.of(config.to_dict())


def _counted(model: Qwen2ForCausalLM, ids: torch.Tensor, **kwargs) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids, **kwargs)
    return counter.get_total_flops()


def test_a_prefill_counts_what_pytorch_counts_with_attention_halved():
    model, shape = _tiny()
    tokens = 37
    counted = _counted(model, torch.randint(0, 100, (1, tokens)), logits_to_keep=1)
    square = 2 * 2 * shape.layers * shape.heads * shape.head_dim * tokens * tokens  # eager: the whole square
    assert shape.prefill(tokens) - 2 * shape.attention(tokens, 0) + square == counted


def test_a_decode_step_counts_what_pytorch_counts():
    model, shape = _tiny()
    ids = torch.randint(0, 100, (1, 20))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    counted = _counted(model, torch.randint(0, 100, (1, 1)), **with_cache(model, cache), use_cache=True)
    assert shape.decode(1, 20) == counted


def test_a_draft_a_fiftieth_of_the_target_costs_little_beside_the_kept_tokens():
    paper = shares(SHAPES["llama-3.1-8b"], SHAPES["llama-3.1-405b"], 16000, 0.1, look_ahead=8, window=1)
    assert paper["draft"] < 0.03 and 0.08 < paper["kept"] < 0.1
    assert abs(paper["total"] - paper["draft"] - paper["kept"]) < 1e-12

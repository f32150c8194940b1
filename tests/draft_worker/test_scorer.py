"""The scorer against a plain reference that spells out every step of SpecPrefill's scoring."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from common.selection import select_chunks
from draft_worker.capture import enable_query_capture
from draft_worker.config import ScoringConfig
from draft_worker.scorer import score_prompts
from tests.helpers import tiny_llama


def local_mask(length: int, prompt_length: int, local: int, block: int = 512) -> torch.Tensor:
    """An explicit additive mask [1, 1, T, T]: causal; a prompt token at i sees only the first 4 keys and those
    from ``local`` before its block of ``block`` (``ScoringConfig.local_attention``); look-ahead tokens see all."""
    rows, keys = torch.arange(length)[:, None], torch.arange(length)[None, :]
    seen = keys <= rows
    if local:
        near = (keys < 4) | (keys >= (rows // block) * block - local)
        seen &= near | (rows >= prompt_length)
    return torch.zeros(length, length).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]


@torch.no_grad()
def reference_scores(
    model, prompt: list[int], look_ahead: int, pool_kernel: int, window: int = 1, local: int = 0
) -> torch.Tensor:
    """Eager attention, full recompute, float64 attention math, explicit loops; no KV cache, no capture hook.
    ``window``: the prompt's last that many tokens' queries (SnapKV's observation window), each over the keys up
    to its own. ``local``: the prompt read with local attention, by an explicit mask."""
    eos = set(model.generation_config.eos_token_id)
    generated: list[int] = []
    for _ in range(look_ahead - 1):
        seq = torch.tensor([prompt + generated])
        mask = local_mask(seq.shape[1], len(prompt), local)
        logits = model(seq, attention_mask=mask).logits[0, -1]
        generated.append(int(logits.argmax()))
    n_queries = 1
    for token in generated:  # query j belongs to generated token j; queries from an EOS on are dropped
        if token in eos:
            break
        n_queries += 1

    seq = torch.tensor([prompt + generated])
    length = len(prompt)
    out = model(seq, output_hidden_states=True, attention_mask=local_mask(seq.shape[1], length, local))
    return reference_reduce(model, out.hidden_states, length, n_queries, window, pool_kernel)


def reference_reduce(
    model, states, length: int, n_queries: int, window: int, pool_kernel: int, dropped=(), from_layer: int = 0
) -> torch.Tensor:
    """From each layer's input hidden states ``states`` ([1, T, E], the prompt's ``length`` tokens then the
    generated ones): the window's and the look-ahead's queries over the prompt keys in float64, softmax, average
    pooling, max over layers × heads, mean over the queries. ``dropped``: prompt tokens that are no keys from layer
    ``from_layer`` on."""
    positions = torch.arange(states[0].shape[1])[None]
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    rows = []  # one [Q, S] attention map per (layer, head)
    for layer_idx, layer in enumerate(model.model.layers):
        hidden = layer.input_layernorm(states[layer_idx])
        attn = layer.self_attn
        q = attn.q_proj(hidden).view(1, -1, config.num_attention_heads, head_dim).transpose(1, 2)
        k = attn.k_proj(hidden).view(1, -1, config.num_key_value_heads, head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(hidden, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = repeat_kv(k, config.num_attention_heads // config.num_key_value_heads)
        first = max(0, length - window)
        q = q[0, :, first : length - 1 + n_queries].double()  # [H, W - 1 + Q, D]
        k = k[0, :, :length].double()  # [H, S, D]
        logits = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        for row in range(length - 1 - first):  # a window query at position first + row sees keys up to it
            logits[:, row, first + row + 1 :] = float("-inf")
        if layer_idx >= from_layer and dropped:
            logits[:, :, list(dropped)] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        for head in range(probs.shape[0]):
            rows.append(probs[head])
    half = pool_kernel // 2
    pooled = []
    for row in rows:  # average pooling, zero padding counted, kernel `pool_kernel`, stride 1
        p = torch.zeros_like(row)
        for i in range(length):
            p[:, i] = row[:, max(0, i - half) : i + half + 1].sum(-1) / pool_kernel
        pooled.append(p)
    best = torch.stack(pooled).max(dim=0).values  # max over layers × heads -> [Q, S]
    return best.mean(dim=0).float()  # mean over queries


def reference_select(scores: torch.Tensor, keep_rate: float, chunk_size: int) -> list[int]:
    chunks = [list(range(i, min(i + chunk_size, len(scores)))) for i in range(0, len(scores), chunk_size)]
    means = [float(scores[c].mean()) for c in chunks]
    k = math.ceil(round(len(chunks) * keep_rate, 9))
    top = sorted(range(len(chunks)), key=lambda i: -means[i])[:k]
    return sorted(i for c in top for i in chunks[c])


def _prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=g).tolist()


@pytest.mark.parametrize("look_ahead", [1, 8])
@pytest.mark.parametrize("pool_kernel,chunk_size", [(13, 32), (1, 1), (13, 1), (1, 32)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_scores_and_selection_match_reference(look_ahead, pool_kernel, chunk_size, heads, kv_heads):
    model = tiny_llama(heads=heads, kv_heads=kv_heads)
    prompt = _prompt(300, seed=heads + kv_heads)
    expected = reference_scores(model, prompt, look_ahead, pool_kernel)

    enable_query_capture(model)
    config = ScoringConfig(look_ahead=look_ahead, pool_kernel=pool_kernel, chunk_size=chunk_size)
    (scores,), _ = score_prompts(model, [prompt], config)

    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-8)
    for keep_rate in (0.1, 0.3, 0.5):
        kept = select_chunks(scores, keep_rate, chunk_size).tolist()
        assert kept == reference_select(expected, keep_rate, chunk_size)


@pytest.mark.parametrize("look_ahead", [1, 8])
@pytest.mark.parametrize("window", [2, 16])
def test_an_observation_window_matches_reference(look_ahead, window):
    """An option beyond the paper: the prompt's last ``window`` tokens' queries join the look-ahead's, each
    reading only the keys before it."""
    model = tiny_llama(heads=4, kv_heads=2)
    prompt = _prompt(300, seed=11)
    enable_query_capture(model)
    config = ScoringConfig(look_ahead=look_ahead, observation_window=window)
    (scores,), _ = score_prompts(model, [prompt], config)
    torch.testing.assert_close(scores, reference_scores(model, prompt, look_ahead, 13, window), rtol=1e-5, atol=1e-8)
    (plain,), _ = score_prompts(model, [prompt], ScoringConfig(look_ahead=look_ahead))
    assert not torch.allclose(scores, plain, rtol=1e-3)


@pytest.mark.parametrize("look_ahead,window", [(1, 1), (8, 16)])
def test_local_attention_matches_reference(look_ahead, window):
    """An option beyond the paper: the draft reads the prompt with local attention (the first 4 keys and 64 before
    each block of 512), its scored queries still over every key. The reference reads it under an explicit mask;
    prompts in one batch score as single runs; a window past the prompt is full attention."""
    model = tiny_llama(heads=4, kv_heads=2)
    prompt = _prompt(1300, seed=13)
    enable_query_capture(model)
    config = ScoringConfig(look_ahead=look_ahead, observation_window=window, local_attention=64)
    (scores,), _ = score_prompts(model, [prompt], config)
    expected = reference_scores(model, prompt, look_ahead, 13, window, local=64)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-7)
    full = ScoringConfig(look_ahead=look_ahead, observation_window=window)
    (plain,), _ = score_prompts(model, [prompt], full)
    assert not torch.allclose(scores, plain, rtol=1e-3)  # the test can see the mask
    batched, _ = score_prompts(model, [prompt[:700], prompt], config)
    (short,), _ = score_prompts(model, [prompt[:700]], config)
    torch.testing.assert_close(batched[0], short)
    torch.testing.assert_close(batched[1], scores)
    wide = ScoringConfig(look_ahead=look_ahead, observation_window=window, local_attention=1300)
    torch.testing.assert_close(score_prompts(model, [prompt], wide)[0][0], plain, rtol=1e-5, atol=1e-8)
    assert config.score_params != full.score_params  # cached scores of one are never served for the other


def test_queries_after_generated_eos_are_dropped():
    model = tiny_llama(seed=3)
    prompt = _prompt(200, seed=5)
    # make the 3rd greedy token an EOS: queries 0..2 count, the EOS token's query and later ones do not
    greedy = model.generate(
        torch.tensor([prompt]), max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert len(set(greedy)) == 3, "pick another seed: the first greedy tokens repeat"
    model.generation_config.eos_token_id = [greedy[2]]
    enable_query_capture(model)
    (scores,), _ = score_prompts(model, [prompt], ScoringConfig(look_ahead=8))
    torch.testing.assert_close(scores, reference_scores(model, prompt, 8, 13), rtol=1e-5, atol=1e-8)
    # and it differs from scoring all 8 queries, so the test can see the rule
    model.generation_config.eos_token_id = [1]
    (all_queries,), _ = score_prompts(model, [prompt], ScoringConfig(look_ahead=8))
    assert not torch.allclose(scores, all_queries, rtol=1e-3)


@pytest.mark.parametrize("look_ahead,window", [(1, 1), (8, 1), (8, 16)])
def test_batched_scoring_equals_one_by_one(look_ahead, window):
    """Left-padded rows score as single runs, a window reaching past a short prompt's start included."""
    model = tiny_llama(seed=7)
    enable_query_capture(model)
    config = ScoringConfig(look_ahead=look_ahead, observation_window=window)
    prompts = [_prompt(n, seed=n) for n in (37, 300, 129, 300, 5)]
    batched, _ = score_prompts(model, prompts, config)
    for prompt, scores in zip(prompts, batched):
        (single,), _ = score_prompts(model, [prompt], config)
        assert scores.shape == (len(prompt),)
        torch.testing.assert_close(scores, single, rtol=1e-5, atol=1e-7)


def test_scores_are_a_distribution_without_pooling():
    model = tiny_llama()
    enable_query_capture(model)
    (scores,), _ = score_prompts(model, [_prompt(100, 1)], ScoringConfig(look_ahead=1, pool_kernel=1))
    # one query: max over heads of distributions, so each entry is a probability and they sum to >= 1
    assert scores.min() >= 0 and scores.max() <= 1 and scores.sum() >= 1 - 1e-5


def test_capture_leaves_plain_forwards_unchanged():
    model = tiny_llama()
    ids = torch.tensor([_prompt(64, 2)])
    before = model(ids).logits
    enable_query_capture(model)
    enable_query_capture(model)  # idempotent
    torch.testing.assert_close(model(ids).logits, before)


def reference_chosen(scores: torch.Tensor, rate: float, window: int) -> list[int]:
    """The tokens that go on past the propagation layer: top ``rate`` by score, the first 4, the last ``window``."""
    length = len(scores)
    top = sorted(range(length), key=lambda i: -float(scores[i]))[: math.ceil(rate * length)]
    return sorted(set(top) | set(range(min(4, length))) | set(range(max(0, length - window), length)))


@torch.no_grad()
def reference_propagated_scores(
    model, prompt: list[int], look_ahead: int, window: int, layer: int, rate: float, pool_kernel: int = 13
) -> tuple[torch.Tensor, list[int]]:
    """Token-selective propagation spelled out with masks instead of gathers: every token is computed in every
    layer, but from ``layer`` on a prompt token that was not chosen is no key for anyone (an explicit additive
    mask per layer, full recompute, no cache). The choice: the window's queries over layers below ``layer``,
    scored as ``reference_scores`` scores (float64, explicit pooling)."""
    length = len(prompt)
    lower = tiny_copy(model, layer)
    chosen = reference_chosen(reference_scores(lower, prompt, 1, pool_kernel, window), rate, window)

    def masks(total: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, keys = torch.arange(total)[:, None], torch.arange(total)[None, :]
        causal = keys <= rows
        gone = torch.ones(total, dtype=torch.bool)
        gone[chosen] = False
        gone[length:] = False
        upper = causal & (~gone[None, :] | (keys == rows))  # a dropped token still sees itself: no empty row
        fill = torch.finfo(torch.float32).min
        return tuple(torch.zeros(total, total).masked_fill(~m, fill)[None, None] for m in (causal, upper))

    def hidden_states(seq: list[int]) -> list[torch.Tensor]:
        full, upper = masks(len(seq))
        hidden = model.model.embed_tokens(torch.tensor([seq]))
        positions = torch.arange(len(seq))[None]
        rotary = model.model.rotary_emb(hidden, positions)
        states = []
        for number, decoder_layer in enumerate(model.model.layers):
            states.append(hidden)
            hidden = decoder_layer(
                hidden,
                attention_mask=full if number < layer else upper,
                position_ids=positions,
                position_embeddings=rotary,
            )
        states.append(model.model.norm(hidden))
        return states

    eos = set(model.generation_config.eos_token_id)
    generated: list[int] = []
    for _ in range(look_ahead - 1):
        generated.append(int(model.lm_head(hidden_states(prompt + generated)[-1])[0, -1].argmax()))
    n_queries = 1
    for token in generated:
        if token in eos:
            break
        n_queries += 1
    dropped = sorted(set(range(length)) - set(chosen))
    states = hidden_states(prompt + generated)
    return reference_reduce(model, states, length, n_queries, window, pool_kernel, dropped, layer), chosen


def tiny_copy(model, layers: int):
    """The same weights, only the first ``layers`` decoder layers."""
    import copy

    from common.models import first_layers

    lower = copy.deepcopy(model)
    first_layers(lower, layers)
    return lower


@pytest.mark.parametrize("look_ahead,window,layer,rate", [(1, 1, 2, 0.2), (8, 16, 1, 0.3), (8, 16, 3, 0.1)])
def test_token_selective_propagation_matches_reference(look_ahead, window, layer, rate):
    """An option beyond the paper (FastKV's token-selective propagation): from ``layer`` on the draft reads only the
    tokens its lower layers ranked highest, at their own positions. The reference computes every token in every
    layer and masks the others out as keys; the implementation gathers the chosen ones."""
    model = tiny_llama(layers=4, heads=4, kv_heads=2, seed=5)
    prompt = _prompt(400, seed=17)
    enable_query_capture(model)
    config = ScoringConfig(look_ahead=look_ahead, observation_window=window, propagate_layer=layer, propagate_rate=rate)
    (scores,), kvs = score_prompts(model, [prompt], config, return_kv=True)
    expected, chosen = reference_propagated_scores(model, prompt, look_ahead, window, layer, rate)
    assert len(chosen) < len(prompt) * (rate + 0.1)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-7)
    assert kvs is None  # a propagated prompt's cache is not one to reuse
    plain = ScoringConfig(look_ahead=look_ahead, observation_window=window)
    (full,), _ = score_prompts(model, [prompt], plain)
    assert not torch.allclose(scores, full, rtol=1e-3)  # the test can see the propagation
    assert config.score_params != plain.score_params  # cached scores of one are never served for the other
    batched, _ = score_prompts(model, [prompt[:250], prompt], config)
    torch.testing.assert_close(batched[1], scores)
    torch.testing.assert_close(batched[0], score_prompts(model, [prompt[:250]], config)[0][0])


@pytest.mark.parametrize("layer,rate", [(2, 1.0), (4, 0.2), (9, 0.2)])
def test_propagation_of_every_token_or_above_the_top_is_the_plain_read(layer, rate):
    """Every token going on, or a propagation layer at or past the top: the same scores as the paper's read."""
    model = tiny_llama(layers=4, seed=2)
    prompt = _prompt(300, seed=19)
    enable_query_capture(model)
    (plain,), _ = score_prompts(model, [prompt], ScoringConfig(look_ahead=8, observation_window=4))
    config = ScoringConfig(look_ahead=8, observation_window=4, propagate_layer=layer, propagate_rate=rate)
    (scores,), _ = score_prompts(model, [prompt], config)
    torch.testing.assert_close(scores, plain, rtol=1e-5, atol=1e-8)

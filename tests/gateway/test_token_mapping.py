"""Drafts with another tokenizer: the mapping's oracle (one tokenizer on both sides gives today's scores exactly),
the projection against a brute-force reference, offsets across multi-byte characters and whitespace, the
template's markup protected, cache keys, and gateways with such a draft, local and remote."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from common.models import TokenizerMismatchError
from common.selection import select_tokens
from draft_worker import DraftWorker, ScoringConfig
from gateway.app import create_app
from gateway.planning.draft import LocalDraft
from gateway.planning.score_cache import score_key
from gateway.planning.token_mapping import MappedDraft, TokenMapping, overlaps
from specprefill_lab.demo_models import synthetic_corpus
from tests.helpers import LONG_DOC, chat_messages, gateway_settings, openai_client, serve, start_command

MIXED = "naïve café — 日本語のテキスト 🙂🙂 done.\n\n  two  spaces\tand a tab, and   more   spaces  "


def sentencepiece_style_tokenizer() -> PreTrainedTokenizerFast:
    """Another family: a BPE with "▁" word starts (no byte fallback: unknown characters become <unk>), its own
    special tokens, none of the demo template's markup."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    corpus = synthetic_corpus(seed=11, n_sentences=3000) + [MIXED, "system user assistant Answer briefly."]
    tokenizer.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )


@pytest.fixture(scope="module")
def other_tokenizer():
    return sentencepiece_style_tokenizer()


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, other_tokenizer) -> Path:
    """A tiny draft model with the other tokenizer, on disk."""
    path = tmp_path_factory.mktemp("other") / "draft"
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=len(other_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path)
    other_tokenizer.save_pretrained(path)
    return path


def chat_ids(tokenizer, messages=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages or chat_messages(), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_one_tokenizer_on_both_sides_gives_todays_scores_exactly(model_pair, tokenizer):
    worker = DraftWorker.from_pretrained(model_pair / "draft", device="cpu", prefix_cache_bytes=0)
    mapping = TokenMapping(tokenizer, tokenizer)
    today, mapped = LocalDraft(worker), MappedDraft(LocalDraft(worker), mapping)
    for ids in (chat_ids(tokenizer), tokenizer(LONG_DOC).input_ids, tokenizer(MIXED).input_ids):
        assert mapping.draft_input(ids).draft_ids == ids
        expected, got = asyncio.run(today.score(ids)), asyncio.run(mapped.score(ids))
        assert torch.equal(expected, got)


def reference_projection(target_spans, draft_spans, draft_scores) -> list[float]:
    """Straightforward: each target token's max over overlapping draft spans; with none, over the nearest draft
    token before and after."""
    out = []
    for a, b in target_spans:
        hits = [draft_scores[j] for j, (c, d) in enumerate(draft_spans) if d > c and b > a and c < b and a < d]
        if not hits:
            before = [j for j, (c, d) in enumerate(draft_spans) if d > c and d <= a]
            after = [j for j, (c, d) in enumerate(draft_spans) if d > c and c >= max(a, b)]
            hits = [draft_scores[j] for j in before[-1:] + after[:1]]
        out.append(max(hits))
    return out


@pytest.mark.parametrize(
    ("target", "draft"),
    [
        ([(0, 3), (3, 4), (4, 9)], [(0, 2), (2, 6), (6, 9)]),  # straddling
        ([(0, 3), (3, 4), (4, 7)], [(0, 3), (4, 7)]),  # a target token the draft skips (whitespace)
        ([(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 4)]),  # one draft token for many target tokens
        ([(0, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]),  # many draft tokens for one target token
        ([(0, 2), (2, 2), (2, 5)], [(0, 0), (0, 3), (3, 5)]),  # zero-width tokens on both sides
    ],
)
def test_projection_equals_a_brute_force_reference(target, draft):
    t_index, d_index = overlaps(np.array(target), np.array(draft))
    scores = torch.rand(len(draft), generator=torch.Generator().manual_seed(0))
    out = torch.full((len(target),), float("-inf")).scatter_reduce(
        0, torch.from_numpy(t_index), scores[torch.from_numpy(d_index)], reduce="amax"
    )
    assert out.tolist() == pytest.approx(reference_projection(target, draft, scores.tolist()))


def test_offsets_across_multibyte_characters_and_whitespace(tokenizer, other_tokenizer):
    """Against the reference on spans taken from each tokenizer's own offsets of the same text."""
    ids = tokenizer(MIXED, add_special_tokens=False).input_ids
    mapping = TokenMapping(tokenizer, other_tokenizer)
    mapped = mapping.draft_input(ids)
    target_spans = tokenizer(MIXED, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    draft = other_tokenizer(MIXED, add_special_tokens=False, return_offsets_mapping=True)
    assert mapped.draft_ids == [other_tokenizer.bos_token_id, *draft.input_ids]
    scores = torch.rand(len(mapped.draft_ids), generator=torch.Generator().manual_seed(1))
    got = mapping.project(scores, mapped).tolist()
    expected = reference_projection(target_spans, draft.offset_mapping, scores[1:].tolist())
    assert got == pytest.approx(expected)
    assert len(set(mapped.target_index.tolist())) == len(ids)  # every target token has a score


def test_template_markup_stays_the_targets_and_is_kept(tokenizer, other_tokenizer):
    ids = chat_ids(tokenizer)
    special = set(tokenizer.all_special_ids)
    mapping = TokenMapping(tokenizer, other_tokenizer)
    mapped = mapping.draft_input(ids)
    draft_text = other_tokenizer.decode(mapped.draft_ids, skip_special_tokens=True)
    assert "<|start_header_id|>" not in draft_text and "Answer briefly." in draft_text
    assert not (set(mapped.target_index.tolist()) & {i for i, t in enumerate(ids) if t in special})
    scores = mapping.project(torch.rand(len(mapped.draft_ids)), mapped)
    kept = set(select_tokens(ids, scores, 0.1, ScoringConfig(), special))
    assert {i for i, t in enumerate(ids) if t in special} <= kept
    # markup the draft knows by name goes to it as its own token (the same family's markup)
    same_family = TokenMapping(tokenizer, tokenizer)
    assert same_family.draft_input(ids).draft_ids == ids


def test_cache_keys_name_both_tokenizers(model_pair, tokenizer, other_tokenizer):
    worker = DraftWorker.from_pretrained(model_pair / "draft", device="cpu", prefix_cache_bytes=0)
    plain = LocalDraft(worker)
    keys = set()
    for draft in (
        plain,
        MappedDraft(plain, TokenMapping(tokenizer, tokenizer)),
        MappedDraft(plain, TokenMapping(tokenizer, other_tokenizer)),
    ):
        keys.add(score_key("specprefill:", asyncio.run(draft.identity()), draft.score_params, [1, 2, 3]))
    assert len(keys) == 3


def test_a_gateway_with_another_tokenizers_draft(model_pair, engine_backend, other_draft):
    settings = gateway_settings(model_pair, backend_url=engine_backend[0], draft_model=str(other_draft))
    with serve(create_app(settings)) as url:
        assert httpx.get(f"{url}/health").json()["draft"]["tokenizer"] == "mapped"
        with openai_client(url) as client:
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=chat_messages(), max_tokens=2, extra_headers={"x-keep-rate": "0.2"}
            )
        assert raw.headers["x-specprefill-status"] == "compressed" and raw.parse().choices[0].message.content
        local = httpx.post(
            f"{url}/v1/specprefill/compress",
            json={"messages": chat_messages()},
            headers={"x-keep-rate": "0.2"},
            timeout=60,
        ).json()
        metrics = httpx.get(f"{url}/metrics").text
        assert "specprefill_draft_mapping_seconds_count" in metrics
    # the same draft as a remote worker: the gateway needs its tokenizer, then selects the same tokens
    port_url = _worker(other_draft)
    process, worker_url = port_url
    try:
        with pytest.raises(TokenizerMismatchError, match="--draft-tokenizer"):
            asyncio.run(
                _start(
                    gateway_settings(
                        model_pair, backend_url=engine_backend[0], draft_model=None, draft_worker_url=[worker_url]
                    )
                )
            )
        settings = gateway_settings(
            model_pair,
            backend_url=engine_backend[0],
            draft_model=None,
            draft_worker_url=[worker_url],
            draft_tokenizer=str(other_draft),
        )
        with serve(create_app(settings)) as url:
            remote = httpx.post(
                f"{url}/v1/specprefill/compress",
                json={"messages": chat_messages()},
                headers={"x-keep-rate": "0.2"},
                timeout=60,
            ).json()
        assert remote["position_ids"] == local["position_ids"]
    finally:
        process.kill()
        process.wait()


def test_mapping_off_refuses_another_tokenizer(model_pair, engine_backend, other_draft):
    settings = gateway_settings(
        model_pair, backend_url=engine_backend[0], draft_model=str(other_draft), draft_tokenizer_mapping="off"
    )
    with pytest.raises(TokenizerMismatchError, match="--draft-tokenizer-mapping auto"):
        asyncio.run(_start(settings))


async def _start(settings):
    from gateway.metrics import GatewayMetrics
    from gateway.wiring import build_serving

    serving = await build_serving(settings, GatewayMetrics())
    await serving.close()


def _worker(model_dir):
    from common.process import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return start_command(["draft-worker", "--model", str(model_dir), "--port", str(port), "--device", "cpu"], url), url


def test_prefix_reuse_and_concurrency_work_through_the_mapping(tokenizer, other_draft):
    """A chat's next turn reuses the draft's KV of the last one; concurrent prompts are scored side by side."""
    worker = DraftWorker.from_pretrained(other_draft, device="cpu", prefix_cache_bytes=64 << 20)
    draft = MappedDraft(LocalDraft(worker), TokenMapping(tokenizer, worker.tokenizer))
    first = chat_ids(tokenizer)
    later = chat_ids(
        tokenizer,
        chat_messages() + [{"role": "assistant", "content": "58445."}, {"role": "user", "content": "And the fourth?"}],
    )
    assert later[: len(first) - 8] == first[: len(first) - 8]
    assert draft.reusable_prefix(later) < len(first) // 2
    asyncio.run(draft.score(first))
    assert draft.reusable_prefix(later) > 0.8 * len(first)

    async def together():
        return await asyncio.gather(draft.score(first), draft.score(later))

    scores = asyncio.run(together())
    alone = [asyncio.run(draft.score(first)), asyncio.run(draft.score(later))]
    for concurrent, sequential in zip(scores, alone):
        torch.testing.assert_close(concurrent, sequential, rtol=1e-4, atol=1e-7)

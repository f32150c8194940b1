"""Chats tokenized piece by piece, the repeated pieces once, exactly as a plain tokenization."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import AddedToken

from common.chat import RenderedChat, render_chat
from common.protocol import ChatMessage
from common.tokenize import PieceCache
from specprefill_lab.demo_models import train_tokenizer
from tests.helpers import LONG_DOC


def test_pieces_give_exactly_the_plain_tokens_and_repeats_come_from_the_cache(tokenizer):
    cache = PieceCache(tokenizer)
    assert cache.enabled
    for question in ("What is it?", "  And this one?  ", "\nTell me\n\n"):
        messages = [ChatMessage(role="system", content=LONG_DOC), ChatMessage(role="user", content=question)]
        fast, plain = render_chat(tokenizer, messages, cache.encode_arrays), render_chat(tokenizer, messages)
        assert fast.token_ids == plain.token_ids and np.array_equal(fast.offsets, plain.offsets)
        assert fast.ids is not None and fast.ids.dtype == np.int64 and fast.ids.tolist() == plain.token_ids
        assert cache.encode(fast.text)[0] == plain.token_ids
    assert "\n\n" + LONG_DOC in cache._pieces  # the system prompt (after its header) was tokenized once


def test_the_cache_holds_no_more_memory_than_its_bound(tokenizer):
    """New documents, one after another (a soak's traffic): the memory the cache keeps, measured, stays within
    its bound in bytes (token IDs kept as Python lists of ints took 14–26 bytes a character, and a bound in
    characters let a gateway grow by 3 MiB a minute for over an hour)."""
    import gc
    import tracemalloc

    bound = 1 << 20
    cache = PieceCache(tokenizer, capacity_bytes=bound)
    documents = [f"Document {n}: " + " ".join(f"w{n * 7 + i}x{i % 13}" for i in range(1500)) for n in range(60)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for document in documents:  # each held by its test's list, so only what the cache adds is counted
        cache.encode(document)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert cache.bytes <= bound
    assert held <= 1.25 * bound, f"{held / 2**20:.2f} MiB held under a bound of {bound / 2**20:.2f} MiB"
    ids, offsets = cache.encode(documents[-1])  # the latest is still there, exactly as a plain tokenization
    plain = tokenizer(documents[-1], add_special_tokens=False, return_offsets_mapping=True)
    assert ids == plain.input_ids and offsets.tolist() == [list(o) for o in plain.offset_mapping]


def test_a_tokenizer_that_strips_beside_special_tokens_is_tokenized_whole():
    tokenizer = train_tokenizer(vocab_size=600)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<|x|>", lstrip=True, rstrip=True)]})
    cache = PieceCache(tokenizer)
    assert not cache.enabled
    text = "Hello <|x|> there"
    assert cache.encode(text)[0] == tokenizer(text, add_special_tokens=False).input_ids


def test_tokens_in_a_span_are_those_that_start_inside_it(tokenizer):
    messages = [ChatMessage(role="system", content=LONG_DOC), ChatMessage(role="user", content="Which one?")]
    rendered = render_chat(tokenizer, messages)
    for span in [s for s in rendered.content_spans(messages) if s] + [(0, 0), (5, 40), (0, len(rendered.text))]:
        expected = [i for i, (a, b) in enumerate(rendered.offsets) if b > a and span[0] <= a < span[1]]
        assert rendered.tokens_in(span) == expected
        assert rendered.token_mask(span).nonzero()[0].tolist() == expected
        marked = np.zeros(len(rendered.token_ids), dtype=bool)
        rendered.mark(marked, span)
        assert marked.nonzero()[0].tolist() == expected
    assert rendered._ordered() is not None  # the binary searches, not the masks, answered above


def test_marking_a_span_where_the_starts_go_back_falls_back_to_the_mask():
    offsets = np.array([[0, 3], [3, 3], [3, 6], [1, 2], [6, 9]])  # an empty token, and one whose start goes back
    rendered = RenderedChat("x" * 9, [1, 2, 3, 4, 5], offsets)
    assert rendered._ordered() is None
    for span in ((0, 9), (1, 4), (3, 3), (5, 7)):
        marked = np.zeros(5, dtype=bool)
        rendered.mark(marked, span)
        assert marked.tolist() == rendered.token_mask(span).tolist()


@pytest.mark.parametrize(
    "suffix",
    [
        "\n\nWhat is the third number?",
        "ber and more",
        " ",
        "  \n  ",
        "日本語 🙂 x",
        "?",
        "0123456789",
        "-" * 40,
        "\t\tword",
    ],
)
def test_a_long_piece_that_begins_with_an_earlier_one_tokenizes_exactly_as_a_whole(tokenizer, suffix):
    """A document, then the document and a question: only the tail is tokenized again, the result identical
    to a plain tokenization (whatever the suffix does at the boundary: continue a word, add whitespace)."""
    cache = PieceCache(tokenizer)
    document = (LONG_DOC + " ") * 4 + "the last words of the docu"
    cache.encode(document)
    for text in (document + suffix, document + suffix + " and again " + suffix):
        ids, offsets = cache.encode(text)
        plain = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids == plain.input_ids and offsets.tolist() == [list(o) for o in plain.offset_mapping]
    assert cache.extended >= 1


def test_the_same_document_with_another_question_reuses_the_documents_tokens(tokenizer):
    cache = PieceCache(tokenizer)
    document = (LONG_DOC + " ") * 4
    for question in ("What is the third number?", "And the fourth one?", "What is the thi", "W"):
        text = document + "\n\n" + question
        ids, offsets = cache.encode(text)
        plain = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids == plain.input_ids and offsets.tolist() == [list(o) for o in plain.offset_mapping]
    assert cache.extended == 3


def _plain(tokenizer, text):
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoding.input_ids, [list(o) for o in encoding.offset_mapping]


@pytest.mark.parametrize("kind", ["prose", "double spaces", "mixed scripts", "one long run", "digits"])
def test_a_long_new_piece_tokenized_in_segments_is_exactly_the_plain_tokenization(tokenizer, kind):
    """Segments tokenized at once and joined where neighbours agree: the same tokens and offsets as one plain
    tokenization, wherever the segment ends fall (inside words, whitespace runs, multi-byte characters)."""
    import random

    from common import tokenize

    rng = random.Random(kind)
    words = LONG_DOC.split()
    text = {
        "prose": lambda: " ".join(rng.choice(words) for _ in range(9000)),
        "double spaces": lambda: "  ".join(rng.choice(words) for _ in range(9000)),
        "mixed scripts": lambda: "".join(
            rng.choice(["日本語", "🙂", " x", "\n", "0123", "--", "ab", "é"]) for _ in range(20000)
        ),
        "one long run": lambda: "-" * 30000 + " " + " ".join(rng.choice(words) for _ in range(3000)),
        "digits": lambda: "".join(rng.choice("0123456789 ,.") for _ in range(40000)),
    }[kind]()
    cache = PieceCache(tokenizer)
    cache._workers = 7  # as on a many-core server, whatever this machine has
    ids, offsets = cache.encode(text)
    assert (ids, offsets.tolist()) == _plain(tokenizer, text)
    assert cache.segmented == 1 and len(text) // tokenize.SEGMENT_CHARS >= 4  # four segments or more


def test_a_seam_without_agreement_falls_back_to_a_plain_tokenization(tokenizer, monkeypatch):
    from common import tokenize

    monkeypatch.setattr(tokenize, "_seam", lambda *args: None)
    cache = PieceCache(tokenizer)
    cache._workers = 4
    text = " ".join([LONG_DOC] * 200)
    ids, offsets = cache.encode(text)
    assert (ids, offsets.tolist()) == _plain(tokenizer, text) and cache.segmented == 0


def test_a_seam_needs_overlap_tokens_in_agreement_not_one_shared_boundary():
    """Two segments that share a token and then part (a false realignment) are joined only where they agree on
    ``OVERLAP`` tokens in a row."""
    from common.tokenize import OVERLAP, _seam

    ids = list(range(400))  # the earlier segment: token i covers characters [4i, 4i + 4)
    offsets = np.array([[4 * i, 4 * i + 4] for i in range(400)])
    tail = offsets[200:]  # the later segment starts at character 800, on the same boundaries
    tail_ids = ids[200:]
    tail_ids[1:10] = [1000 + i for i in range(9)]  # one shared token, then nine that differ
    assert _seam(ids, offsets, 1600, tail_ids, tail) == (210, 10)
    tail_ids[10 + OVERLAP // 2] = 999  # no run of OVERLAP agreeing tokens until after that one
    assert _seam(ids, offsets, 1600, tail_ids, tail) == (211 + OVERLAP // 2, 11 + OVERLAP // 2)


def test_developer_messages_render_as_vllm_renders_them_for_a_template_without_the_role(tokenizer):
    """vLLM turns ``developer`` into ``system`` where the template does not name it, and merges system messages
    that then stand anywhere but first (its ``_consolidate_system_messages``): Codex CLI's prompts."""
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="developer", content="Sandbox."),
        ChatMessage(role="user", content="Hi?"),
        ChatMessage(role="developer", content="Approvals."),
    ]
    rendered = render_chat(tokenizer, messages).text
    expected = render_chat(
        tokenizer,
        [
            ChatMessage(role="system", content="Be brief.\n\nSandbox.\n\nApprovals."),
            ChatMessage(role="user", content="Hi?"),
        ],
    ).text
    assert rendered == expected and "developer" not in rendered
    first = [ChatMessage(role="developer", content="Sandbox."), ChatMessage(role="user", content="Hi?")]
    assert (
        render_chat(tokenizer, first).text
        == render_chat(
            tokenizer, [ChatMessage(role="system", content="Sandbox."), ChatMessage(role="user", content="Hi?")]
        ).text
    )


def _agent_turns(steps: int) -> tuple[list[ChatMessage], list[dict]]:
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i} does step {i}.",
                                          "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        for i in range(3)
    ]  # fmt: skip
    messages = [ChatMessage(role="system", content=LONG_DOC), ChatMessage(role="user", content="Fix the test.")]
    for i in range(steps):
        call = {"id": f"c{i}", "type": "function", "function": {"name": f"tool_{i % 3}", "arguments": '{"x": "y"}'}}
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        messages.append(ChatMessage(role="tool", tool_call_id=f"c{i}", content=f"line {i}: " + "ok " * (50 + i)))
    return messages, tools


def _real_tokenizer():
    from transformers import AutoTokenizer

    from specprefill.real_models.catalog import QWEN_CODER_05B
    from specprefill.real_models.checkpoint import ensure_checkpoint

    return AutoTokenizer.from_pretrained(ensure_checkpoint(QWEN_CODER_05B))


@pytest.mark.parametrize("which", ["demo", "qwen2.5"])
def test_a_chats_next_turn_takes_the_earlier_turns_tokens_and_is_exactly_a_fresh_render(tokenizer, which):
    """An agent's turns, each the last one and more (and one with an earlier message changed, and one that parts
    from the last inside an added token): every render's IDs and offsets equal a plain tokenization of its text,
    on the real pair's ChatML template with tool calls as on the demo's, and later turns took the part they share
    from the turn before."""
    tokenizer = _real_tokenizer() if which == "qwen2.5" else tokenizer
    cache = PieceCache(tokenizer)
    assert cache.enabled
    for steps in (0, 1, 2, 3, 5, 8):
        messages, tools = _agent_turns(steps)
        if steps == 5:  # an earlier tool result edited: the turns part there
            messages[3] = ChatMessage(role="tool", tool_call_id="c0", content="edited")
        fast = render_chat(tokenizer, messages, cache.encode_arrays, tools=tools)
        plain = render_chat(tokenizer, messages, tools=tools)
        assert fast.token_ids == plain.token_ids and np.array_equal(fast.offsets, plain.offsets), steps
    assert cache.continued >= 5
    added = max(tokenizer.get_added_vocab(), key=len)
    head = LONG_DOC + added[:-2]  # the next text parts from this one two characters before an added token ends
    for text in (head + added[-2:] + " one", head + "xy two " + added, head + added[-2:] + " three"):
        ids, offsets = cache.encode_arrays(text)
        plain_ids = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == plain_ids.input_ids and offsets.tolist() == [list(o) for o in plain_ids.offset_mapping]


def test_recent_texts_count_within_the_caches_bound(tokenizer):
    cache = PieceCache(tokenizer, capacity_bytes=1 << 20)
    for n in range(40):
        cache.encode(f"Document {n}: " + " ".join(f"w{n * 7 + i}x{i % 13}" for i in range(1500)))
        assert cache.bytes + cache.recent_bytes <= 1 << 20 and cache.recent_bytes <= (1 << 20) // 4


@pytest.mark.parametrize("which", ["demo", "qwen2.5"])
def test_the_template_rendered_without_transformers_copies_is_exactly_its_render(tokenizer, which):
    """``template_text`` renders the compiled template on the request's own dicts: the text equals
    ``apply_chat_template``'s on the demo's and the real pair's templates, for chats with a system prompt, a
    developer message, tools, tool calls and their results, reasoning, names and absent contents."""
    from common.chat import _TEMPLATE_HELPERS, developer_as_system, template_text, template_tools

    assert _TEMPLATE_HELPERS is not None  # the render without the copies, not apply_chat_template's own
    tokenizer = _real_tokenizer() if which == "qwen2.5" else tokenizer
    messages, tools = _agent_turns(3)
    tools[0]["function"]["strict"] = True
    reasoned = {"role": "assistant", "content": "Done.", "reasoning": "It was the cache."}
    chats = [
        [ChatMessage(role="user", content="Hi?")],
        messages,
        [ChatMessage(role="developer", content="Be brief."), *messages[1:], ChatMessage.model_validate(reasoned)],
        [ChatMessage(role="system", content="S."), ChatMessage(role="user", content="Q?", name="ana")],
    ]
    for chat in chats:
        for schemas in (None, template_tools(tools)):
            plain = developer_as_system([m.for_template() for m in chat], tokenizer.chat_template)
            expected = tokenizer.apply_chat_template(plain, tools=schemas, tokenize=False, add_generation_prompt=True)
            assert template_text(tokenizer, plain, schemas) == expected
            assert plain == developer_as_system([m.for_template() for m in chat], tokenizer.chat_template)  # unchanged

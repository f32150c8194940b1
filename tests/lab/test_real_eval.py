"""The real-model eval's parts: haystacks of real prose and real code with their planted facts, the drafts named as
the tables show them, the frontier, and a resume that asks again only what could go otherwise. The pair's
checkpoints are made once per machine (test_checkpoints.py)."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from specprefill.real_models.catalog import PAIRS
from specprefill_lab.haystack import RULES, make_code_haystack, make_haystack
from specprefill_lab.prose import paragraphs
from specprefill_lab.real_eval import EvalPair
from specprefill_lab.source_code import pieces


@pytest.fixture(scope="module")
def qwen() -> EvalPair:
    return EvalPair.made(PAIRS["qwen2.5-coder"])


@pytest.fixture(scope="module")
def smollm2() -> EvalPair:
    return EvalPair.made(PAIRS["smollm2"])


def _counter(pair: EvalPair):
    tokenizer = AutoTokenizer.from_pretrained(pair.target)

    def count(messages):
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))

    return count


def test_haystacks_asked_elsewhere_are_the_ones_written_here(qwen, smollm2, tmp_path):
    from specprefill_lab.real_eval import CROSS_DRAFT, draft_limit, items, load_items, save_items, variants

    asked = items(qwen, (600,), 2, rule_lengths=(600,))
    assert [i.sample.task for i in asked if i.index == 0] == ["passkey", "fact", "two-fact", "code", "rule"]
    assert {i.sample.rule for i in asked if i.sample.task == "rule"} == {"json"}
    save_items(asked, tmp_path / "haystacks.jsonl")
    assert load_items(tmp_path / "haystacks.jsonl") == asked  # another Python's standard library is other prose
    assert items(qwen, (600,), 1, rule_lengths=(600,)) == [i for i in asked if i.index == 0]  # more samples: more
    drafts = variants(smollm2, (4,))
    assert draft_limit(drafts["cross"]) == 2048 and CROSS_DRAFT.is_dir()  # 8,192 of its tokens, ~4 to one of ours
    assert draft_limit(drafts["self-4"]) == 8192 and draft_limit(drafts["random"]) is None
    assert "cross" not in variants(qwen) and "code" not in {i.sample.task for i in items(smollm2, (600,), 1)}


def test_a_draft_with_an_observation_window_is_its_own_variant_and_row(qwen, smollm2):
    from specprefill_lab.real_eval import markdown_summary, summarize, variants

    drafts = variants(smollm2, (8,), windows=(16,))
    assert drafts["self-8/w16"] == [*drafts["self-8"], "--observation-window", "16"]
    assert "random/w16" not in drafts  # a baseline has no attention to window
    assert smollm2.default_variant == "self-8/w16"
    drafts = variants(qwen, (4,), (12,), windows=(16,))
    assert drafts["0.5b"] == ["--draft-model", str(qwen.draft)]
    assert drafts["0.5b-12/w16"] == [*drafts["0.5b-12"], "--observation-window", "16"]
    assert qwen.default_variant == "0.5b/w16/cap64"  # what `make serve` runs, one of the rows
    assert drafts[qwen.default_variant] == [*drafts["0.5b/w16"], "--max-chunks", "64"]
    assert variants(qwen, (4,))["0.5b/w16"] == [*drafts["0.5b"], "--observation-window", "16"]
    rows = [
        {
            "task": "fact",
            "length": 2000,
            "variant": v,
            "keep": k,
            "correct": c,
            "tokens": 2000,
            "kept": 200,
            "obeys": None,
        }
        for v, k, c in (
            ("full", 1.0, True),
            ("random", 0.1, False),
            ("0.5b-8", 0.1, True),
            ("self-8/w16", 0.1, True),
            ("0.5b", 0.1, True),
            ("self-8", 0.1, False),
            ("target", 0.1, True),
        )
    ]
    table = "\n".join(markdown_summary(summarize(rows)))
    order = ["| target", "| self-8 ", "| self-8/w16", "| 0.5b ", "| 0.5b-8", "| random"]
    assert [table.index(row) for row in order] == sorted(table.index(row) for row in order)


def test_a_variant_of_ones_own_is_its_gateway_flags():
    from specprefill_lab.real_eval import named_variants

    got = named_variants(["0.5b/p8=--draft-model /d  --propagate-layer 8", "w4 = --observation-window 4"])
    assert got == {
        "0.5b/p8": ["--draft-model", "/d", "--propagate-layer", "8"],
        "w4": ["--observation-window", "4"],
    }
    for bad in ("=--look-ahead 4", "name=", "name"):
        with pytest.raises(ValueError, match="NAME=GATEWAY FLAGS"):
            named_variants([bad])


def test_the_prose_is_real_and_the_haystacks_plant_every_fact(qwen):
    prose = paragraphs()
    assert len(prose) > 500 and all(len(p) >= 200 for p in prose)
    count = _counter(qwen)
    samples = make_haystack(2000, random.Random(3), count)
    assert [s.task for s in samples] == ["passkey", "fact", "two-fact"]
    bodies = {s.messages[-1]["content"].rsplit("\n\n", 1)[0] for s in samples}
    assert len(bodies) == 1  # one haystack, three questions
    for s in samples:
        assert 1900 <= count(s.messages) <= 2300
        assert s.answer in s.messages[-1]["content"].rsplit("\n\n", 1)[0]
    two = samples[2]
    assert abs(two.depths[1] - two.depths[0]) >= 0.25


def test_vllm_gets_a_tool_parser_only_where_the_tokenizer_has_its_marker(qwen, smollm2):
    from specprefill_lab.demo_models import ensure_demo_models
    from specprefill_lab.launch import README_VLLM_ARGS, readme_vllm_args

    # SmolLM2's tokenizer has no tool-call marker: vLLM refuses llama3_json for it at start
    assert readme_vllm_args(smollm2.target) == ("--enable-prompt-tokens-details",)
    assert readme_vllm_args(qwen.target)[-2:] == ("--tool-call-parser", "hermes")  # Qwen2.5's <tool_call>
    assert readme_vllm_args(ensure_demo_models() / "target") == README_VLLM_ARGS  # Llama 3.1's marker


def test_the_code_haystack_is_real_source_with_one_changed_default(qwen):
    count = _counter(qwen)
    assert len(pieces()) > 1000
    for seed in range(3):
        sample = make_code_haystack(2000, random.Random(seed), count)
        code = sample.messages[-1]["content"]
        assert sample.task == "code" and 1900 <= count(sample.messages) <= 3200
        assert code.count(f"def {code.rsplit('function `', 1)[1].split('`')[0]}(") == 1  # the function, once
        assert sample.answer in code.split("```")[1] and "Answer with the value alone." in code
        assert sample.correct(f"The default is {sample.answer}.") and not sample.correct("None")


def test_the_rules_check_what_they_say():
    assert RULES["json"].obeyed('```json\n{\n  "answer": "Mibaqui"\n}\n```')
    assert RULES["json"].obeyed('{"answer": "Mibaqui') and not RULES["json"].obeyed("Mibaqui")
    assert RULES["french"].obeyed("Elle est née à Mibaqui.") and not RULES["french"].obeyed("She was born there.")


def test_the_frontier_reads_a_bench_folder_or_its_json_as_the_docs_keep_it(tmp_path):
    from specprefill_lab.real_eval import frontier, summarize

    rows = [
        {"task": t, "length": 2000, "variant": v, "keep": k, "correct": c, "tokens": 2000, "kept": 200, "obeys": None}
        for t in ("passkey", "fact")
        for v, k, c in (("full", 1.0, True), ("self-8", 0.1, False), ("self-8", 0.3, True))
    ]
    bench = {"rows": [{"tokens": 2000, "keep_rate": 0.1, "gateway_s": 1.0, "direct_s": 4.0}]}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "self-8.json").write_text(json.dumps(bench))
    want = [
        {
            "draft": "self-8",
            "keep": 0.1,
            "length": 2000,
            "ttft_of_direct": 0.25,
            "accuracy_of_full": 0.0,
            "tasks": ["fact", "passkey"],
        }
    ]
    cells = summarize(rows)
    assert frontier(cells, [("self-8", tmp_path / "run")]) == frontier(cells, [("self-8", tmp_path / "self-8.json")])
    assert frontier(cells, [("self-8", tmp_path / "run")]) == want
    # a draft named again for a run at another length: each run's points
    rows += [{**r, "length": 8000} for r in rows]
    (tmp_path / "8k.json").write_text(json.dumps({"rows": [{**bench["rows"][0], "tokens": 8000, "gateway_s": 2.0}]}))
    both = frontier(summarize(rows), [("self-8", tmp_path / "run"), ("self-8", tmp_path / "8k.json")])
    assert [(p["length"], p["ttft_of_direct"]) for p in both] == [(2000, 0.25), (8000, 0.5)]


def test_answered_counts_as_a_resume_does_the_later_file_winning(tmp_path):
    from specprefill_lab.real_eval import answered

    row = {"length": 2000, "index": 0, "task": "fact", "variant": "0.5b", "keep": 0.1, "status": "compressed"}
    (tmp_path / "a.jsonl").write_text(json.dumps({**row, "correct": False}) + "\n")
    failed = {**row, "index": 1, "status": "bypassed", "reason": "draft_failed", "correct": True}
    (tmp_path / "b.jsonl").write_text(json.dumps({**row, "correct": True}) + "\n" + json.dumps(failed) + "\n")
    assert answered([tmp_path / "a.jsonl", tmp_path / "b.jsonl"]) == [{**row, "correct": True}]


def test_a_resume_asks_again_only_what_could_go_otherwise(tmp_path):
    from specprefill_lab.real_eval import _done

    base = {"length": 4000, "task": "fact", "keep": 0.1}
    rows = [
        {**base, "index": 0, "variant": "full", "status": "bypassed", "reason": "off"},
        {**base, "index": 1, "variant": "self-8", "status": "compressed", "reason": None},
        {**base, "index": 2, "variant": "self-8", "status": "bypassed", "reason": "draft_error"},  # asked again
        {**base, "index": 3, "variant": "cross", "status": "bypassed", "reason": "prompt_too_long"},  # would be again
        {**base, "index": 4, "variant": "cross", "status": "bypassed"},  # before answers kept the reason
    ]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(r["index"] for r in _done(tmp_path / "answers.jsonl").values()) == [0, 1, 3]


def test_a_resume_asks_again_a_wrong_answer_cut_at_a_lower_limit(tmp_path):
    from specprefill_lab.real_eval import MAX_TOKENS, _done, answered

    base = {"length": 2000, "task": "code", "keep": 0.1, "variant": "0.5b", "status": "compressed"}
    rows = [
        {**base, "index": 0, "max_tokens": 24, "finish": "length", "correct": False},  # asked again
        {**base, "index": 1, "max_tokens": 24, "finish": "length", "correct": True},  # the longer one begins so
        {**base, "index": 2, "max_tokens": 24, "finish": "stop", "correct": False},  # it had ended
        {**base, "index": 3, "max_tokens": MAX_TOKENS, "finish": "length", "correct": False},  # at today's limit
        {**base, "index": 4, "correct": False},  # not known to be cut
    ]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sorted(r["index"] for r in _done(tmp_path / "answers.jsonl").values()) == [1, 2, 3, 4]
    # the tables count it as it stands (wrong) until it is asked again
    assert sorted(r["index"] for r in answered([tmp_path / "answers.jsonl"])) == [0, 1, 2, 3, 4]
    # a run in another dtype would not make the cut answer longer, but draw another: it asks again only its own
    computed = {0: "bfloat16", 1: "float32", 2: "float32", 3: "float32"}
    typed = [{**r, "dtype": computed[r["index"]]} for r in rows if r["index"] in computed]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in typed))
    assert sorted(r["index"] for r in _done(tmp_path / "answers.jsonl", dtype="float32").values()) == [0, 1, 2, 3]
    assert sorted(r["index"] for r in _done(tmp_path / "answers.jsonl", dtype="bfloat16").values()) == [1, 2, 3]


def test_auto_cells_follow_the_fixed_rates_with_the_rates_applied():
    from specprefill_lab.real_eval import _key, keep_request, markdown_summary, summarize

    rows = [
        {
            "task": "fact",
            "length": 8000,
            "variant": v,
            "keep": k,
            "correct": True,
            "tokens": 8000,
            "kept": kept,
            "applied": kept / 8000,
            "obeys": None,
        }
        for v, k, kept in (
            ("full", 1.0, 8000),
            ("0.5b", 0.1, 800),
            ("0.5b", "auto@0.5", 900),
            ("0.5b", "auto@0.5", 1100),
            ("0.5b", 0.3, 2400),
        )
    ]
    table = "\n".join(markdown_summary(summarize(rows)))
    assert "| draft | keep 0.3 | keep 0.1 | keep auto@0.5 |" in table
    assert "rate 0.12 ± 0.01" in table
    assert keep_request("auto@0.8") == ({"x-keep-rate": "auto"}, {"specprefill": {"auto_target": 0.8}})
    assert keep_request(1.0)[0] == {"x-specprefill": "off"} and _key(8000, 3, "fact", "0.5b", "auto@0.8").endswith(
        "/auto@0.8"
    )


def test_cells_are_paired_with_the_whole_prompt_on_the_same_haystacks():
    """Lost and gained answers against the whole prompt's on the same haystacks, with the exact McNemar p: the
    cells share haystacks, so the pairs say more than two intervals side by side."""
    from specprefill_lab.real_eval import markdown_summary, mcnemar, summarize

    whole = [True] * 8 + [False] * 2
    kept = [False] * 5 + [True] * 3 + [True, False]  # 5 lost, 1 gained
    rows = [
        {"task": "code", "length": 16000, "index": i, "variant": v, "keep": k, "correct": c, "tokens": 16000, "kept": n}
        for v, k, n, answers in (("full", 1.0, 16000, whole), ("0.5b/w16", 0.1, 1600, kept))
        for i, c in enumerate(answers)
    ]
    (cell,) = [c for c in summarize(rows) if c["variant"] != "full"]
    assert (cell["pairs"], cell["lost"], cell["gained"]) == (10, 5, 1)
    assert cell["paired_p"] == mcnemar(5, 1) == 2 * 7 / 64
    assert mcnemar(0, 0) == 1.0 and mcnemar(3, 3) == 1.0 and mcnemar(0, 6) == 2 / 64
    assert "40% [17%–69%]; −5 +1 (p 0.22)" in "\n".join(markdown_summary(summarize(rows)))
    # the share of the whole prompt's answers is read on the haystacks both asked: the whole prompt asked on 4 more,
    # all wrong, does not move it
    more = [{**rows[0], "index": 10 + i, "correct": False} for i in range(4)]
    (cell,) = [c for c in summarize(rows + more) if c["variant"] != "full"]
    assert cell["of_full"] == 4 / 8 and cell["pairs"] == 10

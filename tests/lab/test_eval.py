"""The retrieval evaluation on tiny trained models: baselines under the one selection rule, the eval, the command."""

from __future__ import annotations

import json
import random

import pytest
import torch

from common.selection import select_tokens
from draft_worker import ScoringConfig
from specprefill.cli import main
from specprefill_lab.eval import baseline_indices, evaluate_retrieval
from specprefill_lab.retrieval import SHIPPED_PAIR, make_tokenizer
from specprefill_lab.session_eval import evaluate_sessions, format_sessions
from specprefill_lab.training import PairShape, save, train


def test_baselines_spend_the_same_budget_under_the_same_rule():
    config = ScoringConfig()
    ids, keep = list(range(10, 1034)), 0.2  # whole chunks: each method keeps [budget, budget + 32) tokens
    ids[500] = 3  # a special token: kept by every method
    reference = select_tokens(ids, torch.rand(len(ids)), keep, config, special_ids={3})
    for method in ("random", "head", "tail"):
        kept = baseline_indices(method, ids, keep, config, random.Random(0), special_ids={3})
        assert abs(len(kept) - len(reference)) < config.chunk_size, method  # one budget, in tokens
        assert kept[0] == 0 and kept[-1] == len(ids) - 1 and 500 in kept  # protected ends and the special token
    head = baseline_indices("head", ids, keep, config, random.Random(0))
    tail = baseline_indices("tail", ids, keep, config, random.Random(0))
    assert head[:150] == list(range(150)) and tail[-150:] == list(range(len(ids) - 150, len(ids)))


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


@pytest.mark.parametrize(
    "args,message",
    [
        (["--pair", "{tmp}"], "needs draft/ and target/ model folders"),
        (["--pair", "{tmp}", "--train"], "give --pair DIR or --train, not both"),
    ],
)
def test_builtin_eval_rejects_a_folder_without_a_pair_and_pair_with_train(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["eval", *[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path)])
    assert excinfo.value.code == 2 and message in capsys.readouterr().err


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
    with pytest.raises(SystemExit) as excinfo:
        main(
            [
                "eval",
                "--pair",
                str(tiny_retrieval_pair),
                "--samples",
                "2",
                "--words",
                "120",
                "--keep-rates",
                "0.3,1.0",
                "--out",
                str(tmp_path),
            ]
        )
    assert excinfo.value.code == 0
    payload = json.loads((tmp_path / "eval.json").read_text())
    assert payload["samples"] == 2 and (tmp_path / "eval.png").exists()


def test_the_session_eval_runs_through_a_live_gateway_and_reports_plans(tiny_retrieval_pair, tmp_path):
    """The logic of the sessions eval (two forms, warming on and off, the plan of every request); its numbers
    come from the shipped pair in the README, not from this tiny one."""
    results = evaluate_sessions(tiny_retrieval_pair, samples=2, words=700, questions=3, keep_rate=0.1)
    assert [(r.form, r.warming) for r in results] == [
        ("turns", True),
        ("requests", True),
        ("turns", False),
        ("requests", False),
    ]
    for result in results:
        assert result.asked == [2, 2, 2] and all(sum(p.values()) == 2 for p in result.plans)
        assert result.plans[0] == {"fresh": 2}  # the first question: a cold document
        assert 0.05 < result.kept_fraction[0] < 0.3
    warm = next(r for r in results if r.form == "requests" and r.warming)
    assert "whole" not in warm.plans[1]  # the document came back: compressed, and warmed
    assert warm.plans[2] == {"whole": 2}  # so the third question reads it whole
    assert "turn 2" in format_sessions(results)


def test_the_cross_tokenizer_eval_command(tmp_path):
    """Its logic on a few samples (two live gateways, the mapping's cost); its numbers are in the README."""
    with pytest.raises(SystemExit) as excinfo:
        main(
            [
                "eval",
                "--cross-tokenizer",
                "--samples",
                "3",
                "--words",
                "300",
                "--keep-rates",
                "0.3",
                "--out",
                str(tmp_path),
            ]
        )
    assert excinfo.value.code == 0
    payload = json.loads((tmp_path / "cross-tokenizer.json").read_text())
    assert [r["tokenizer"] for r in payload["results"]] == ["shared", "mapped"]
    assert set(payload["results"][1]["accuracy"]) == {"full", "0.3"}
    assert payload["mapping_cost"]["target_tokens"] > 3000 and payload["mapping_cost"]["ratio"] > 0

"""The RULER-style suite: its generators (answers follow from the prompt alone; seeds reproduce), the training
batches, the baseline drafts through a gateway, and a small end-to-end run of ``specprefill eval --suite``."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch

from common.models import load_causal_lm, load_tokenizer
from common.selection import select_tokens
from draft_worker import ScoringConfig
from draft_worker.baselines import BaselineScorer, baseline_kind
from specprefill.cli import main
from specprefill_lab.launch import launched_gateway
from specprefill_lab.retrieval import SHIPPED_PAIR
from specprefill_lab.retrieval import vocabulary as retrieval_vocabulary
from specprefill_lab.suite import (
    FAMILIES,
    TaskSample,
    answer_from_prompt,
    make_task,
    make_tokenizer,
    samples,
    vocabulary,
)
from specprefill_lab.suite_training import Stage, suite_batch, train_suite_model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("words", [200, 1500])
def test_every_answer_follows_from_its_prompt(family, words):
    rng = random.Random(f"{family}{words}")
    known = set(vocabulary())
    for _ in range(20):
        sample = make_task(family, rng, words, n_questions=4)
        assert 0.8 * words <= len(sample.context) <= 1.3 * words + 150
        for question, answer in sample.qa:
            prompt = " ".join(sample.context + question)
            assert answer_from_prompt(family, prompt) == " ".join(answer)
            assert set(prompt.split()) <= known and set(answer) <= known


def test_the_families_ask_what_they_say():
    rng = random.Random(3)
    multivalue = make_task("multivalue", rng, 800)
    assert 2 <= len(multivalue.answer.split()) <= 3
    multiquery = make_task("multiquery", rng, 800)
    keys = multiquery.prompt.split()[-6:-3]
    assert multiquery.prompt.split()[-1] == keys[0] and multiquery.answer.split()[1::2] == keys[1:]
    variables = make_task("variables", rng, 800)
    chain = variables.answer.split()
    assert len(chain) == 3 and chain[-1].startswith("v") and all(w.startswith("k") for w in chain[:-1])
    for hop in ([variables.prompt.split()[-1]] + chain)[:-1]:
        assert variables.prompt.count(f"set {hop} ") == 1  # one statement per hop: no shortcut, no ambiguity
    aggregation = make_task("aggregation", rng, 2000)
    counts = sorted(
        (aggregation.prompt.split().count(w) for w in set(aggregation.prompt.split()) if w.startswith("v")),
        reverse=True,
    )
    assert counts[0] >= 1.5 * counts[1]  # one clear winner, spread over the whole context


def test_seeds_reproduce_and_families_draw_their_own_streams():
    assert samples("variables", 3, 500, seed=5) == samples("variables", 3, 500, seed=5)
    assert samples("variables", 3, 500, seed=5) != samples("variables", 3, 500, seed=6)
    # asking for more samples, or for another family first, leaves the earlier ones as they were
    assert samples("single", 3, 500, seed=5)[:2] == samples("single", 2, 500, seed=5)
    assert samples("single", 2, 500, seed=5)[0].context != samples("multivalue", 2, 500, seed=5)[0].context
    with pytest.raises(ValueError, match="unknown task family"):
        make_task("haystack", random.Random(0), 100)


def test_training_batches_point_at_answers_and_their_eos():
    tokenizer = make_tokenizer()
    batch = suite_batch(random.Random(0), tokenizer, 2048, 256)
    assert batch.ids[:, 0].eq(tokenizer.bos_token_id).all()
    assert batch.ids[batch.eos_rows, batch.eos_pos].eq(tokenizer.eos_token_id).all()
    answers = tokenizer.convert_ids_to_tokens(batch.ids[batch.answer_rows, batch.answer_pos].tolist())
    assert all(a[0] in "vk" for a in answers)
    # every answer token is preceded by its question or the answer so far, never by padding
    assert batch.ids[batch.answer_rows, batch.answer_pos - 1].ne(tokenizer.pad_token_id).all()


def test_the_suite_models_start_from_the_retrieval_pair_with_the_suite_vocabulary(tmp_path):
    """Two steps of the recipe's stages: the retrieval pair's words keep their IDs and embeddings."""
    stages = (Stage(1, 1e-3, ((1.0, 64),), (1, 1, 1, 1, 1)), Stage(1, 1e-3, ((1.0, 64),), (0, 0, 0, 1, 0)))
    train_suite_model("draft", tmp_path, stages=stages)
    model, start = load_causal_lm(tmp_path / "draft"), load_causal_lm(SHIPPED_PAIR / "draft")
    assert model.config.vocab_size == len(vocabulary()) == len(retrieval_vocabulary()) + 7
    shared = len(retrieval_vocabulary())
    embeddings, before = model.get_input_embeddings().weight, start.get_input_embeddings().weight
    assert (embeddings[:shared] - before).abs().max() < 0.01  # two small steps from where it started
    k7 = make_tokenizer().convert_tokens_to_ids("k7")
    assert load_tokenizer(tmp_path / "draft").convert_tokens_to_ids("k7") == k7


def test_task_samples_hold_the_first_question_as_the_prompt():
    sample = TaskSample("single", ["w1", "."], [(["question", ":"], ["v1"]), (["x"], ["v2"])])
    assert sample.prompt == "w1 . question :" and sample.answer == "v1"


def test_baseline_scorers_keep_what_their_names_say():
    config, ids = ScoringConfig(), list(range(5, 1005))
    head = select_tokens(ids, BaselineScorer("head", config).score(ids), 0.1, config)
    tail = select_tokens(ids, BaselineScorer("tail", config).score(ids), 0.1, config)
    assert head[:64] == list(range(64)) and tail[-64:] == list(range(936, 1000))
    random_scorer = BaselineScorer("random", config)
    assert torch.equal(random_scorer.score(ids), random_scorer.score(ids))  # seeded by the prompt
    assert not torch.equal(random_scorer.score(ids), random_scorer.score(ids[::-1]))
    assert baseline_kind("models/draft") is None and baseline_kind("baseline:tail") == "tail"
    with pytest.raises(ValueError, match="baseline:random"):
        baseline_kind("baseline:middle")


def test_a_gateway_serves_a_baseline_in_place_of_a_draft():
    """``--draft-model baseline:tail`` through a live gateway: the kept positions are the prompt's last chunks."""
    args = [
        "--target-model",
        str(SHIPPED_PAIR / "target"),
        "--draft-model",
        "baseline:tail",
        "--served-model-name",
        "suite",
        "--planner",
        "fresh",
        "--min-prompt-tokens",
        "64",
        "--device",
        "cpu",
    ]
    sample = samples("single", 1, 600, seed=1)[0]
    with launched_gateway(args) as url:
        response = httpx.post(
            f"{url}/v1/specprefill/compress",
            json={"prompt": sample.prompt, "specprefill": {"keep_rate": 0.25}},
            timeout=60,
        )
    response.raise_for_status()
    positions, length = response.json()["position_ids"], response.json()["original_tokens"]
    assert positions[-1] == length - 1 and len(positions) < 0.5 * length
    head = 4  # the protected first tokens, kept one by one
    assert positions[:head] == list(range(head))
    assert positions[head:] == list(range(length - len(positions) + head, length))  # then the tail


def test_the_suite_eval_command_end_to_end(tmp_path):
    """Its logic on a few samples (live gateways, baselines, the upper bound); its numbers are in the README."""
    with pytest.raises(SystemExit) as excinfo:
        main(
            [
                "eval",
                "--suite",
                "--families",
                "single,variables",
                "--methods",
                "specprefill,tail,upper",
                "--suite-samples",
                "2",
                "--suite-words",
                "300",
                "--suite-keep-rates",
                "0.1,1",
                "--out",
                str(tmp_path),
            ]
        )
    assert excinfo.value.code == 0
    payload = json.loads((tmp_path / "suite.json").read_text())
    assert set(payload["full"]) == {"single", "variables"}
    assert [m["variant"] for m in payload["methods"]] == ["specprefill", "tail", "upper"]
    assert set(payload["methods"][0]["accuracy"]["variables"]) == {"0.1", "1"}
    assert payload["methods"][2]["accuracy"]["single"]["1"] == payload["full"]["single"]  # keep 1: the whole prompt
    assert (tmp_path / "suite.png").exists()


def test_the_suite_eval_rejects_unknown_names(tmp_path, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["eval", "--suite", "--families", "haystack", "--out", str(tmp_path)])
    assert excinfo.value.code == 2 and "unknown haystack" in capsys.readouterr().err

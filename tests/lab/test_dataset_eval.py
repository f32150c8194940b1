"""The dataset mode: metrics, JSONL rows, and a run against a live gateway."""

from __future__ import annotations

import json

import pytest

from specprefill_lab.dataset_eval import evaluate_dataset, exact_match, f1, load_dataset, rouge_l, substring
from tests.helpers import LONG_DOC


def test_metrics():
    assert exact_match("The Answer.", ["answer"]) == 1.0 and exact_match("an answer here", ["answer"]) == 0.0
    assert substring("so the answer is Paris!", ["paris"]) == 1.0
    assert f1("paris france", ["paris"]) == pytest.approx(2 / 3)
    assert rouge_l("the cat sat on the mat", ["cat on mat"]) == pytest.approx(2 * 0.75 * 1 / 1.75)


def test_dataset_mode_against_a_live_gateway(gateway_url, tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": LONG_DOC + "\n\nWhat?"}], "answers": ["nothing"], "metric": "f1"},
        {"prompt": LONG_DOC + " Which?", "answers": ["x"]},
    ]
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

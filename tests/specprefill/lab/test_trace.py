"""Trace replay (``specprefill bench --trace``): a Mooncake trace's blocks become text that is the same wherever
a hash ID recurs; the committed slice replays through both paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specprefill.lab.trace import load_trace, replay_schedule, seen_shares

SLICE = Path(__file__).resolve().parents[3] / "specprefill" / "data" / "traces" / "mooncake-conversation-40.jsonl"


class Texts:
    """PromptMaker's ``text``, counted: a new text each call."""

    def __init__(self) -> None:
        self.calls = 0

    def text(self, tokens: int) -> str:
        self.calls += 1
        return f"block{self.calls} " + "word " * tokens


def test_shared_hash_ids_are_shared_text_and_times_scale(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 1400, "output_length": 900, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 6000, "input_length": 600, "output_length": 2, "hash_ids": [0, 4]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    requests = load_trace(trace)
    assert seen_shares(requests) == [0.0, 0.75, 0.5]
    texts = Texts()
    schedule = replay_schedule(requests, texts, block_tokens=8, clock=2.0, max_output=16)
    assert texts.calls == 5  # one text per hash ID
    first, second, third = (r.messages[0]["content"] for r in schedule)
    assert second.startswith(first[: first.index("block3")])  # the shared blocks, the same text
    assert third.startswith("block1 ") and "block2" not in third
    assert [r.send_s for r in schedule] == [0.0, 1.5, 3.0] and [r.max_tokens for r in schedule] == [5, 16, 2]


def test_a_line_that_is_not_a_request_is_named(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="t.jsonl:2"):
        load_trace(trace)


def test_the_committed_slice_replays_through_both_paths(model_pair, tmp_path):
    from specprefill.commands.bench import Bench, run_bench

    out = tmp_path / "trace"
    options = Bench(
        _cli_parse_args=[
            "--trace", str(SLICE), "--trace-requests", "10", "--trace-block-tokens", "32", "--trace-clock", "4",
            "--trace-max-output", "4", "--pair", str(model_pair), "--out", str(out),
        ]
    )  # fmt: skip
    assert run_bench(options) == 0
    report = json.loads((out / "trace.json").read_text())
    samples = report["samples"]
    assert len(samples) == 20 and all(s["ttft_s"] is not None and not s["error"] for s in samples), samples
    assert all(s["reported_cached"] is not None for s in samples)
    summary = report["summary"]
    assert summary["paths"]["gateway"]["all"]["n"] == summary["paths"]["direct"]["all"]["n"] == 10
    assert "all" in summary["ratio"] and summary["plans"]

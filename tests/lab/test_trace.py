"""Trace replay (``specprefill bench --trace``): a Mooncake trace's blocks become text that is the same wherever
a hash ID recurs; the committed slice replays through both paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specprefill_lab.trace import TraceRequest, conversations, load_trace, max_qps, replay_schedule, seen_shares, select

SLICE = Path(__file__).resolve().parents[2] / "lab/specprefill_lab/data/traces/mooncake-conversation-40.jsonl"


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


def test_a_cut_keeps_whole_conversations_within_its_window():
    def request(at: float, *ids: int) -> TraceRequest:
        return TraceRequest(at, 512 * len(ids), 1, (0, *ids))

    trace = [
        request(0, 1, 2),  # conversation A
        request(1, 3),  # B
        request(2, 4, 5),  # C
        request(50, 1, 2, 6),  # A's next turn
        request(60, 7),  # D
        request(70, 3, 8),  # B's next turn
        request(200, 1, 2, 6, 9),  # A's third turn, past the window below
    ]
    assert conversations(trace) == [0, 1, 2, 0, 4, 1, 0]
    assert select(trace, every=2) == [trace[0], trace[2], trace[3], trace[6]]  # A and C, every turn
    assert select(trace, seconds=100, every=2) == [trace[0], trace[2], trace[3]]
    assert select(trace, seconds=100, limit=2) == trace[:2]
    kept = select(trace, every=2)
    assert seen_shares(kept) == [0.0, 1 / 3, 0.75, 0.8]  # block 0, then A's turns repeat A's blocks


def test_max_qps_is_the_fastest_clock_under_the_objective_for_each_path():
    def run(gateway: float, direct: float, failed: int = 0) -> dict:
        return {
            "paths": {
                "gateway": {"failed": 0, "all": {"p90": gateway}},
                "direct": {"failed": failed, "all": {"p90": direct}},
            }
        }

    result = max_qps({0.5: run(2.0, 4.0), 1.0: run(3.0, 12.0), 2.0: run(8.0, 30.0), 4.0: run(20.0, 60.0)}, 10.0)
    assert result["max_clock"] == {"gateway": 2.0, "direct": 0.5} and result["ratio"] == 4.0
    assert result["p90"]["direct"] == {0.5: 4.0, 1.0: 12.0, 2.0: 30.0, 4.0: 60.0}
    # the gateway's capacity is in [2, 4) clocks, direct's in [0.5, 1): the ratio is over 2 and under 8
    assert result["ratio_range"] == [2.0, 8.0]
    # a failed request disqualifies its run; direct under the objective at no clock: at least 1 / 0.5
    result = max_qps({0.5: run(2.0, 4.0, failed=1), 1.0: run(3.0, 12.0)}, 10.0)
    assert result["max_clock"]["direct"] is None and result["ratio"] is None and result["ratio_range"] == [2.0, None]
    assert max_qps({1.0: run(11.0, 12.0)}, 10.0)["ratio_range"] == [0.0, None]
    # direct met the objective at 1 and missed it at 2, the gateway met it at 2: over 2 / 2, no more said
    result = max_qps({1.0: run(3.0, 4.0), 2.0: run(8.0, 30.0)}, 10.0)
    assert result["ratio"] == 2.0 and result["ratio_range"] == [1.0, None]
    result = max_qps({1.0: run(3.0, 4.0), 2.0: run(30.0, 8.0)}, 10.0)
    assert result["ratio"] == 0.5 and result["ratio_range"] == [0.0, 1.0]
    assert max_qps({1.0: run(3.0, 4.0), 2.0: run(8.0, 9.0)}, 10.0)["ratio_range"] == [0.0, None]
    # the vLLM replay of docs/results/traces.md: direct missed it at 1, the gateway met it at 4: at least 4x
    assert max_qps({1.0: run(3.1, 77.6), 4.0: run(9.9, 390.0)}, 10.0)["ratio_range"] == [4.0, None]


def test_a_line_that_is_not_a_request_is_named(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="t.jsonl:2"):
        load_trace(trace)


def test_the_committed_slice_replays_through_both_paths(model_pair, tmp_path):
    from specprefill_lab.commands.bench import Trace

    out = tmp_path / "trace"
    options = Trace(
        _cli_parse_args=[
            str(SLICE), "--requests", "10", "--block-tokens", "32", "--clocks", "4", "--max-output", "4",
            "--pair", str(model_pair), "--out", str(out), "--foreign-tokens", "256", "--foreign-every", "0.5",
        ]
    )  # fmt: skip
    assert options.run() == 0  # one replay per clock, each in its own folder, and the max-QPS ratio beside
    assert (out / "clock-4" / "trace.png").exists() and "ratio" in json.loads((out / "max-qps.json").read_text())
    report = json.loads((out / "clock-4" / "trace.json").read_text())
    samples = report["samples"]
    assert len(samples) == 20 and all(s["ttft_s"] is not None and not s["error"] for s in samples), samples
    assert all(s["reported_cached"] is not None for s in samples)
    summary = report["summary"]
    assert summary["paths"]["gateway"]["all"]["n"] == summary["paths"]["direct"]["all"]["n"] == 10
    assert "all" in summary["ratio"] and summary["plans"]
    assert summary["predicted_within_2x"]["n"] == 10  # the gateway priced each request and timed its backend
    # a second client sent its own prompts straight to each path's engine meanwhile
    assert report["meta"]["foreign"] == {"tokens": 256, "every_s": 0.5}
    assert all(report["meta"]["foreign_sent"][path] >= 1 for path in ("gateway", "direct"))

"""The bench's logic on tiny models: the math, a live sweep and load run, its outputs. No timings asserted."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from specprefill_lab.bench import (
    BenchConfig,
    PromptMaker,
    Sample,
    ideal_speedup,
    parse_server_timing,
    run_sweep,
    summarize,
)
from specprefill_lab.load import max_rate_meeting, percentile, poisson_arrivals, run_load
from specprefill_lab.report import write_outputs


def test_ideal_and_efficiency_from_samples():
    samples = [
        Sample("direct", 1000, 1.0, 10.0),
        Sample("direct", 1000, 1.0, 12.0),
        Sample("gateway", 1000, 0.1, 2.0, 100, {"tokenize": 1, "draft": 500, "select": 1, "backend": 1400}),
        Sample("gateway", 1000, 0.1, 2.2, 100, {"tokenize": 1, "draft": 500, "select": 1, "backend": 1600}),
        Sample("direct_kept", 1000, 0.1, 1.0, 100),
    ]
    (row,) = summarize(samples, [0.1])
    assert row.direct_s == 11.0 and row.gateway_s == pytest.approx(2.1)
    assert row.ideal == pytest.approx(ideal_speedup(11.0, 0.5, 1.0)) == pytest.approx(11.0 / 1.5)
    assert row.speedup == pytest.approx(11.0 / 2.1)
    assert row.efficiency == pytest.approx(row.speedup / row.ideal)
    assert row.breakdown_ms["gateway_overhead"] == pytest.approx(2100 - 1 - 500 - 1 - 1500)


def test_small_helpers():
    assert parse_server_timing("tokenize;dur=1.5, draft;dur=20") == {"tokenize": 1.5, "draft": 20.0}
    assert parse_server_timing(None) == {}
    assert percentile([1, 2, 3, 4], 0.5) == 2 and percentile(list(range(1, 101)), 0.99) == 99
    results = [
        {"rate": 1, "p99_s": 0.5, "errors": 0},
        {"rate": 2, "p99_s": 0.9, "errors": 0},
        {"rate": 4, "p99_s": 3.0, "errors": 0},
        {"rate": 3, "p99_s": 0.5, "errors": 2},
    ]
    assert max_rate_meeting(results, 1.0) == 2 and max_rate_meeting(results, 0.1) is None
    arrivals = poisson_arrivals(50.0, 20.0, random.Random(0))
    assert 900 < len(arrivals) < 1100 and arrivals == sorted(arrivals)


def test_made_prompts_are_counted_through_a_copy_that_begins_otherwise():
    """The gateway's tokenization cache reuses a long text that begins like one it has seen: the text the bench
    counts must not begin like the text it then measures, or the measured request would skip its tokenizing."""
    from common.tokenize import HEAD_CHARS

    counted = []

    class Counting:  # the gateway's /v1/specprefill/compress, counting four characters a token
        def post(self, url, json, headers):
            content = json["messages"][0]["content"]
            counted.append(content)
            return httpx.Response(200, json={"original_tokens": len(content) // 4}, request=httpx.Request("POST", url))

    prompts = PromptMaker(Counting(), "http://gateway", "tiny")
    made = [prompts.make(2000)[0]["content"] for _ in range(3)]
    assert len(counted) == 4  # the characters-per-token probe, then one count per prompt
    assert all(c[:HEAD_CHARS] != m[:HEAD_CHARS] for c in counted for m in made)
    assert all(abs(len(m) // 4 - 2000) <= 100 for m in made)
    # another run (another maker) draws from the same seeds: its documents still begin otherwise
    again = PromptMaker(Counting(), "http://gateway", "tiny")
    assert all(
        a[:HEAD_CHARS] != m[:HEAD_CHARS] for a in (again.make(2000)[0]["content"] for _ in range(3)) for m in made
    )


def test_a_live_sweep_and_load_run(gateway_url, engine_backend, tmp_path):
    engine_url, _ = engine_backend
    with httpx.Client(timeout=60) as client:
        prompts = PromptMaker(client, gateway_url, "tiny")
        messages = prompts.make(300)
        assert abs(prompts.count(messages) - 300) <= 30
        config = BenchConfig(gateway_url, engine_url, "tiny", "target", [200], [0.3, 1.0], repeats=1, warmup=0)
        samples, rows = asyncio.run(run_sweep(config, prompts))
    assert {s.path for s in samples} == {"direct", "gateway", "direct_kept"}
    assert [r.keep_rate for r in rows] == [0.3, 1.0]
    assert rows[0].kept_tokens < rows[1].kept_tokens and rows[1].ideal == 1.0
    bodies = [{"model": "tiny", "messages": messages, "max_tokens": 1}]
    load = asyncio.run(run_load(f"{gateway_url}/v1/chat/completions", bodies, {"x-keep-rate": "0.3"}, [4.0], 1.0))
    assert load[0]["errors"] == 0 and load[0]["requests"] >= 1 and load[0]["p99_s"] >= load[0]["p50_s"]
    written = write_outputs(tmp_path, rows, samples, {"slo_s": 1.0, "results": {"gateway": load}}, {"x": 1})
    assert {p.name for p in written} == {"bench.json", "ttft.png", "load.png"}
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["rows"][0]["efficiency"] == rows[0].efficiency
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"


def _paths(gateway_url: str, engine_url: str, keep: str = "1"):
    from specprefill_lab.workloads import PathTarget

    return [
        PathTarget("gateway", gateway_url, "tiny", {"x-keep-rate": keep}, engine_url),
        PathTarget("direct", engine_url, "target", {}, engine_url),
    ]


def test_a_live_idle_run_alternates_the_paths_and_compares_the_engines(gateway_url, engine_backend):
    """Idle mode: each request goes through both paths, the first path alternating from one request to the next;
    the last request sent whole then goes directly to both engines (here one engine twice: only the mechanics)."""
    from specprefill_lab.workloads import build_workloads, compare_engines, last_whole_request, run_workloads

    engine_url, _ = engine_backend
    with httpx.Client(timeout=60) as client:
        prompts = PromptMaker(client, gateway_url, "tiny")
        workloads = build_workloads(prompts, ["system", "chat"], 3, 200, 50)
    samples = asyncio.run(
        run_workloads(
            "idle", {"gateway": workloads, "direct": workloads}, _paths(gateway_url, engine_url), [gateway_url]
        )
    )
    order = [(s.workload, s.index, s.path) for s in samples]
    assert order[:6] == [
        ("system", 0, "gateway"),
        ("system", 0, "direct"),
        ("system", 1, "direct"),
        ("system", 1, "gateway"),
        ("system", 2, "gateway"),
        ("system", 2, "direct"),
    ]
    assert all(s.queue_s is not None and s.queued >= 1 for s in samples)  # the engine's queue time, per request
    messages = last_whole_request(workloads, samples)  # keep rate 1: every request went whole
    assert messages == workloads[-1].requests[-1]
    engines = asyncio.run(compare_engines({"a": engine_url, "b": engine_url}, "target", messages, [], rounds=2))
    assert [len(v) for v in engines["seconds"].values()] == [2, 2] and engines["ratio"] > 0


@pytest.mark.parametrize("mode", ["back-to-back", "think"])
def test_a_live_run_as_traffic_arrives_sends_each_paths_sequence_on_its_own(gateway_url, engine_backend, mode):
    """Back-to-back and think modes: one path's whole sequence, every workload in turn, then the other's; a
    request leaves when the previous answer ended, or a think time after it."""
    from specprefill_lab.workloads import build_workloads, run_workloads, summarize_workloads

    engine_url, _ = engine_backend
    with httpx.Client(timeout=60) as client:
        prompts = PromptMaker(client, gateway_url, "tiny")
        agent = "agent" if mode == "think" else "agent-messages"  # Anthropic's form, to /v1/messages on both paths
        workloads = build_workloads(prompts, ["document", agent], 3, 200, 50)
    samples = asyncio.run(
        run_workloads(
            mode,
            {"gateway": workloads, "direct": workloads},
            _paths(gateway_url, engine_url, keep="0.3"),
            [gateway_url],
            think_s=0.2,
            first="direct",
        )
    )
    assert [s.path for s in samples] == ["direct"] * 6 + ["gateway"] * 6
    assert [(s.workload, s.index) for s in samples[:6]] == [
        ("document", 0),
        ("document", 1),
        ("document", 2),
        (agent, 0),
        (agent, 1),
        (agent, 2),
    ]
    steps = [s for s in samples if s.workload == agent]
    assert all(s.ttft_s > 0 for s in steps) and steps[-1].status == "compressed" and steps[2].cached_tokens > 0
    for path in ("gateway", "direct"):
        mine = [s for s in samples if s.path == path]
        gaps = [b.at_s - a.at_s - a.ttft_s for a, b in zip(mine, mine[1:])]
        assert all((g >= 0.2) == (mode == "think") for g in gaps), gaps
    rows = summarize_workloads(samples)
    assert [r["workload"] for r in rows] == ["document", agent]
    assert all("later_p90_ratio" in r and r["requests"][0]["predicted_within_2x"] is not None for r in rows)


def test_the_percentile_interpolates_and_predictions_are_checked_within_2x():
    from specprefill_lab.workloads import percentile, within_2x

    assert percentile([1, 2, 3, 4, 5, 6], 0.9) == pytest.approx(5.5) and percentile([3.0], 0.9) == 3.0
    assert within_2x(100, 60) and within_2x(100, 200) and not within_2x(100, 201) and within_2x(None, 5) is None


def test_mixed_sessions_run_the_same_schedule_through_both_paths_and_give_the_max_rate(gateway_url, engine_backend):
    from specprefill_lab.sessions import KINDS, SessionSample, run_sessions, session_schedule, summarize_sessions

    engine_url, _ = engine_backend
    with httpx.Client(timeout=60) as client:
        prompts = PromptMaker(client, gateway_url, "tiny")
        schedule = session_schedule(prompts, 20.0, 6, 200, 50, seed=1, think=(0.01, 0.02))
        again = session_schedule(prompts, 20.0, 6, 200, 50, seed=1, think=(0.01, 0.02))
    assert sorted(s.kind for s in schedule) == sorted(KINDS)  # each kind once in six
    assert [s.start_s for s in schedule] == sorted(s.start_s for s in schedule)
    assert [(s.kind, s.start_s) for s in again] == [(s.kind, s.start_s) for s in schedule]  # seeded
    samples = []
    for path in _paths(gateway_url, engine_url, keep="0.3"):
        samples += asyncio.run(run_sessions(path, schedule, 20.0))
    assert len(samples) == 2 * sum(len(s.requests) for s in schedule) and all(s.ttft_s for s in samples)
    summary = summarize_sessions(samples)
    assert set(summary["rates"][0]["ratios"]["kinds"]) == set(KINDS)
    assert 0.0 <= summary["predicted_within_2x"] <= 1.0  # the gateway's compressed requests carry both times

    def synthetic(rate: float, path: str, p90: float) -> list[SessionSample]:
        return [SessionSample(rate, path, i, "fresh", 0, p90 * (i + 1) / 10) for i in range(10)]

    fake = [
        *synthetic(0.1, "direct", 1.0),
        *synthetic(0.1, "gateway", 0.5),
        *synthetic(0.2, "direct", 3.0),
        *synthetic(0.2, "gateway", 0.8),
        *synthetic(0.4, "direct", 9.0),
        *synthetic(0.4, "gateway", 3.0),
    ]
    summary = summarize_sessions(fake)
    assert summary["objective_s"] == pytest.approx(2 * 0.91)
    assert summary["max_rate"] == {"gateway": 0.2, "direct": 0.1} and summary["max_rate_ratio"] == 2.0
    assert summary["predicted_within_2x"] is None  # no timings, no share
    fake[10].timing_ms = {"predicted": 100.0, "backend": 150.0}  # a gateway sample: within 2x
    fake[11].timing_ms = {"predicted": 100.0, "backend": 500.0}  # 5x off
    fake[0].timing_ms = {"predicted": 100.0, "backend": 500.0}  # the direct path's: not counted
    assert summarize_sessions(fake)["predicted_within_2x"] == 0.5


def test_a_shared_engine_workload_run_sends_the_direct_path_other_documents(gateway_url, engine_backend):
    """``--shared-engine``: both paths at one engine, the direct path's requests over other documents of the
    same length, so that neither finds the other's contexts in the engine's cache."""
    from specprefill_lab.workloads import build_workloads, run_workloads

    engine_url, _ = engine_backend
    with httpx.Client(timeout=60) as client:
        prompts = PromptMaker(client, gateway_url, "tiny")
        for _ in range(50):  # past the documents other tests sent this engine
            prompts.text(10)
        workloads = build_workloads(prompts, ["document"], 2, 200, 50)
        mirrored = build_workloads(prompts, ["document"], 2, 200, 50)
    samples = asyncio.run(
        run_workloads(
            "idle", {"gateway": workloads, "direct": mirrored}, _paths(gateway_url, engine_url), [gateway_url]
        )
    )
    assert [(s.index, s.path) for s in samples] == [(0, "gateway"), (0, "direct"), (1, "direct"), (1, "gateway")]
    cached = {(s.index, s.path): s.cached_tokens for s in samples}
    # the gateway's document went first, whole: had the direct path sent it too, the engine would serve it
    assert cached[0, "direct"] < 64 < cached[1, "direct"] and cached[1, "gateway"] > 64


def test_workloads_that_disturb_the_engine_act_on_each_paths_engine_before_their_requests(gateway_url, engine_backend):
    """foreign and restart: the action runs at the path's engine before the request it is due for, outside its
    time; each gateway request's predicted cached tokens are recorded beside the engine's."""
    from specprefill_lab.bench import predicted_cached
    from specprefill_lab.workloads import build_workloads, cache_prediction_share, run_workloads, summarize_workloads

    engine_url, _ = engine_backend
    with httpx.Client(timeout=60) as client:
        prompts = PromptMaker(client, gateway_url, "tiny")
        workloads = build_workloads(prompts, ["foreign", "restart"], 4, 200, 50)
    assert workloads[0].before == {1: "foreign", 2: "foreign", 3: "foreign"} and workloads[1].before == {2: "restart"}
    acted = []

    async def act(action, path, last):
        acted.append((action, path.name))

    samples = asyncio.run(
        run_workloads(
            "back-to-back",
            {"gateway": workloads, "direct": workloads},
            _paths(gateway_url, engine_url, keep="0.3"),
            [gateway_url],
            act=act,
        )
    )
    assert acted == [("foreign", "gateway")] * 3 + [("restart", "gateway")] + [("foreign", "direct")] * 3 + [
        ("restart", "direct")
    ]
    assert all(s.predicted_cached is not None for s in samples if s.path == "gateway")
    assert cache_prediction_share(summarize_workloads(samples)) is not None
    assert predicted_cached('backend;dur=3.0, plan;desc="fresh", cached;desc="96"') == 96
    assert predicted_cached("backend;dur=3.0") is None
    with pytest.raises(ValueError, match="restart"):  # without a launched stack
        asyncio.run(
            run_workloads(
                "back-to-back",
                {"gateway": workloads[1:], "direct": workloads[1:]},
                _paths(gateway_url, engine_url, keep="0.3"),
                [gateway_url],
            )
        )


def test_bench_has_a_subcommand_for_each_thing_it_measures_each_with_its_own_options():
    """``specprefill bench`` was one command of 70 flags; each measurement now takes only what it reads."""
    from specprefill.reference import cli_options

    options = {name: {f for a in actions for f in a.option_strings} for name, actions in cli_options().items()}
    kinds = ("sweep", "load", "workloads", "agents", "trace", "chaos", "merge")
    assert {n for n in options if n.startswith("bench")} == {f"bench {kind}" for kind in kinds}
    assert "--lengths" in options["bench sweep"] and "--rates" in options["bench load"]
    assert "--arrivals" in options["bench workloads"] and "--arrivals" not in options["bench sweep"]
    assert "--clocks" in options["bench trace"] and "--lengths" not in options["bench trace"]
    assert options["bench merge"] - {"-h", "--help"} == {"--out"}  # and its files, positional
    assert max(len(flags) for name, flags in options.items() if name.startswith("bench")) <= 40

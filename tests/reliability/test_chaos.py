"""The chaos run and the soak, short: faults of every part under a steady mixed load, then the same load without
faults (``specprefill_lab.chaos``); the full runs are ``specprefill bench chaos`` (docs: Operations)."""

from __future__ import annotations

import asyncio
import math
import shutil

import pytest

from specprefill_lab.chaos import DRAIN_S, FAULTS, format_chaos, run_chaos
from specprefill_lab.demo_models import ensure_demo_models


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make test installs it)")
def test_faults_under_load_lose_nothing_and_change_no_answer(tmp_path):
    # the demo pair, whose target costs 32x its draft: compressing is the planner's normal answer there, so the
    # time to compress again says when a part's return was noticed (the tests' tiny pair would go whole)
    report = asyncio.run(run_chaos(ensure_demo_models(), tmp_path, fault_s=3.0, calm_s=4.0, rate=2.0, tokens=1200))
    summary = report.summary()
    print(format_chaos(summary))
    assert summary["lost"] == 0 and summary["unshaped_errors"] == 0, summary
    assert summary["wrong_answers"] == 0 and summary["engine_answers_checked"] > 20, report.wrong_answers
    # 5xx only from requests that lived while the one engine was down: a clean 502, or a stream it cut off
    # mid-answer ended by an error event (load shed past the queue bound aside)
    allowed = ("engine: 502 backend_error", "engine: 500 upstream_error")
    assert all(key in allowed for key in summary["errors_5xx"]), (
        summary["errors_5xx"],
        summary["proxy_failures"],
    )
    # the burst: shed at once with Retry-After; what was admitted met the time predicted for it
    assert summary["shed"]["without_retry_after"] == 0 and summary["shed"]["slowest_s"] < 1.0, summary["shed"]
    # (as well as in the calm before the faults, on this machine at this hour: its own share moved 0.62-0.88)
    # a share of a few answers each: the burst may fall below the calm's by two standard errors of the two
    within, counts = summary["predicted_within_2x"], summary["predicted_counts"]
    calm = min(0.8, within["calm"])
    spread = 2 * math.sqrt(calm * (1 - calm) * (1 / counts["burst"] + 1 / counts["calm"]))
    assert within["burst"] >= calm - max(0.1, spread), (within, counts)
    # big bodies beside the load: refused, /health answering as fast as in the calm, memory given back
    bodies = summary["bodies"]
    assert bodies["statuses"] and all(key.endswith(": 400") for key in bodies["statuses"]), bodies
    assert bodies["slowest_s"] < 2.0, bodies
    before, after = bodies["rss_mib"]
    assert after <= before * 1.05 + 16, bodies
    health = summary["health_slowest_s"]
    assert health["bodies"] <= max(1.0, 2 * health["calm"]), health
    assert [f["fault"] for f in summary["faults"]] == list(FAULTS)
    # each part's return noticed: compressing again within 10 s, or, where the queue the fault left shed or cut
    # off what came meanwhile (a slow machine), no more than one long prompt answered whole before it
    assert all(
        f["compressing_again_after_s"] is not None
        and (f["compressing_again_after_s"] <= 10 or f["whole_before_compressing"] <= 1)
        for f in summary["faults"]
    ), summary["faults"]
    assert summary["restart_mispredicted"] == 0
    # no fault taught the target's cost model a price it does not have once the part is back
    assert all(
        0.5 <= price <= 2 for phase, prices in summary["target_prices"].items() if phase != "start" for price in prices
    ), summary["target_prices"]
    # the drain: long answers are ended at its limit, none before it, in shape (a 503 with Retry-After, or an error
    # event and [DONE] on a stream); short ones finish where this machine answers within half the limit (its
    # slowest answer in the calm, the yardstick: 2 AVX2 cores took 3-5 s a request there, and a short one was cut at
    # the 5 s limit); a request after the signal gets a 503
    sigterm = summary["sigterm"]
    assert sigterm["sent_after_the_signal"] == 503, sigterm
    cut_off = {cut["number"]: cut for cut in sigterm["cut_off"]}
    assert set(sigterm["long_answers"]) <= set(cut_off), sigterm
    calm_slowest = max(s.seconds for s in report.samples if s.phase == "calm" and s.status == 200)
    if calm_slowest <= DRAIN_S / 2:
        assert sigterm["statuses"].get("200", 0) >= 2, (sigterm, calm_slowest)
    for cut in cut_off.values():
        assert cut["shaped"] and cut["cause"] == "overloaded_error", cut
        assert cut["seconds"] >= DRAIN_S, cut
        assert (cut["status"] == 503 and cut["retry_after"]) or (
            cut["stream"] and cut["status"] == 500 and cut["done"]
        ), cut


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server (make test installs it)")
def test_a_short_soak_holds_memory_and_file_descriptors_flat(tmp_path):
    # the soak's short version: new documents and shared ones at a steady rate, no faults; the full hour is
    # ``specprefill bench chaos --soak-s 3600`` (docs: Operations). Its answers are not asked again of a fresh
    # engine (35 s here): the chaos run above checks them, under faults
    soak = {"calm_s": 55.0, "faults": (), "sample_s": 5.0, "check_answers": False}
    report = asyncio.run(run_chaos(ensure_demo_models(), tmp_path, rate=2.0, tokens=1200, **soak))
    summary = report.summary()
    assert summary["lost"] == 0 and summary["statuses"].get("200", 0) >= summary["requests"] - 8, summary["statuses"]
    growth = report.growth(25.0)
    # open files: 60 requests in the measured 30 s, so a leak of one a request adds about 60; the pools'
    # keep-alive connections follow the traffic's peak concurrency (seen: floors 28, then 31, samples 28-36)
    assert growth is not None and growth["rss_growth"] <= 1.05 and growth["fds"][1] <= growth["fds"][0] + 8, growth

"""The start-up probe kept for the next start with the same models, settings and machine
(``gateway.planning.probe_record``): a real in-process engine and draft on the tiny pair, each start built as
`specprefill serve` builds it."""

from __future__ import annotations

import asyncio
import json
import logging

from gateway.metrics import GatewayMetrics
from gateway.planning.probe_record import ProbeRecord
from gateway.wiring import build_serving
from tests.helpers import gateway_settings


def _start(settings, caplog) -> tuple[dict, dict, str]:
    """One start: its cost models' coefficients, and its log."""

    async def run():
        serving = await build_serving(settings, GatewayMetrics())
        try:
            planner = serving.planner
            return planner.target_cost.describe(), planner.draft_cost.describe()
        finally:
            await serving.close()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specprefill.gateway"):
        target, draft = asyncio.run(run())
    return target, draft, caplog.text


def test_a_second_start_fits_the_first_starts_probe_and_probes_nothing(model_pair, tmp_path, caplog):
    settings = gateway_settings(model_pair, calibrate=True, calibration_dir=str(tmp_path))
    target, draft, log = _start(settings, caplog)
    assert "timing the cost models' start-up probe" in log and "cost models calibrated on prompts up to" in log
    [path] = tmp_path.glob("*.json")
    record = json.loads(path.read_text())
    assert len(record["target"]) >= 8 and len(record["draft"]) >= 8  # every probe prompt's timing
    again_target, again_draft, log = _start(settings, caplog)
    assert (
        "start-up probe:" not in log and "cost models calibrated" not in log and "fitted on the start-up probe" in log
    )
    assert again_target == target and again_draft == draft  # fitted as the probe's own were
    # settings that change nothing a probe times keep the record; one that does, and other models, do not
    relabelled = gateway_settings(
        model_pair, calibrate=True, calibration_dir=str(tmp_path), port=9999, served_model_name="other"
    )
    assert ProbeRecord.for_settings(relabelled).path == path
    for changed in (
        gateway_settings(model_pair, calibrate=True, calibration_dir=str(tmp_path), observation_window=4),
        gateway_settings(
            model_pair, calibrate=True, calibration_dir=str(tmp_path), target_model=str(model_pair / "draft")
        ),
    ):
        assert ProbeRecord.for_settings(changed).path != path
    # an engine or a draft behind a URL keeps no record; nor does a gateway told not to
    assert ProbeRecord.for_settings(settings.model_copy(update={"backend_url": ["http://127.0.0.1:1"]})) is None
    assert ProbeRecord.for_settings(settings.model_copy(update={"reuse_calibration": False})) is None


def test_an_unreadable_record_is_probed_again_and_replaced(model_pair, tmp_path, caplog):
    settings = gateway_settings(model_pair, calibrate=True, calibration_dir=str(tmp_path))
    path = ProbeRecord.for_settings(settings).path
    path.write_text('{"target": [[[1.0, 2.0]')  # a write cut short (records are written whole, renamed in)
    _, _, log = _start(settings, caplog)
    assert "not used (JSONDecodeError): probing again" in log and "cost models calibrated" in log
    assert len(json.loads(path.read_text())["target"]) >= 8
    assert not list(tmp_path.glob(".probe-*"))  # nothing half-written left beside it

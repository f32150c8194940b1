"""The start-up probe's timings kept for the next start with the same models, settings and machine.

The probe (``calibration``) reads prompts of up to 4,096 tokens through the target and the draft: on 2 CPU cores
with the real pair, minutes of every start. Its timings depend on what reads them: the models' files, the
gateway's settings, the machine (its processor, its threads, torch). A start that finds a record made under the
same of all three fits the cost models on its timings, as the probe's own would have been fitted, and skips the
probe; the models then learn from traffic as after any probe. Only for an engine and a draft in this process: an
engine or a draft behind a URL can change under the same address. A record is one JSON file, written whole in
one rename, named by the hash of what it depends on; one that cannot be read is probed again and replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from common.cache_folder import default_cache_dir
from gateway.planning.planner import Planner
from gateway.settings import GatewaySettings

logger = logging.getLogger("specprefill.gateway")
VERSION = 1
# settings that change nothing a probe times: where the gateway listens, what it logs, names, keys, the record's own
UNTIMED = frozenset(
    {
        "host",
        "port",
        "log_level",
        "log_json",
        "otlp_endpoint",
        "drain_timeout",
        "api_key",
        "backend_api_key",
        "served_model_name",
        "model_alias",
        "agent_model_names",
        "metrics_public",
        "workers",
        "calibrate",
        "reuse_calibration",
        "calibration_dir",
    }
)


class ProbeRecord:
    """The record file of one gateway's probe (``path``), and what it depends on (``ingredients``)."""

    def __init__(self, path: Path, ingredients: dict[str, Any]) -> None:
        self.path = path
        self.ingredients = ingredients

    @classmethod
    def for_settings(cls, settings: GatewaySettings) -> ProbeRecord | None:
        """The record this gateway would use; None where no record is kept (an engine or a draft elsewhere)."""
        if settings.backend_url or settings.draft_worker_url or not settings.reuse_calibration:
            return None
        ingredients = {
            "version": VERSION,
            "settings": {k: v for k, v in settings.model_dump(mode="json").items() if k not in UNTIMED},
            "models": {"target": _files(settings.target_model), "draft": _files(settings.draft_model)},
            "machine": _machine(),
        }
        digest = hashlib.sha256(json.dumps(ingredients, sort_keys=True, default=str).encode()).hexdigest()[:32]
        folder = Path(settings.calibration_dir) if settings.calibration_dir else default_cache_dir() / "calibration"
        return cls(folder / f"{digest}.json", ingredients)

    def restore(self, planner: Planner) -> bool:
        """The cost models fitted on the recorded timings; False (and nothing changed) where there is none."""
        try:
            record = json.loads(self.path.read_text())
            timings = {name: [(list(f), float(s)) for f, s in record[name]] for name in ("target", "draft")}
            if record["ingredients"] != self.ingredients or not all(timings.values()):
                raise ValueError("another gateway's record, or an empty one")
        except FileNotFoundError:
            return False
        except Exception as exc:  # unreadable, or not this gateway's: probed again, and replaced
            logger.warning("start-up probe record %s not used (%s): probing again", self.path, type(exc).__name__)
            return False
        planner.target_cost.restore_probe(timings["target"])
        planner.draft_cost.restore_probe(timings["draft"])
        logger.info(
            "cost models fitted on the start-up probe of %s (%s; --no-reuse-calibration probes again): target %s, "
            "draft %s",
            record.get("created", "?"),
            self.path,
            planner.target_cost.describe(),
            planner.draft_cost.describe(),
        )
        return True

    def save(self, planner: Planner) -> None:
        """This start's probe timings, for the next start (a failure to write is logged, never raised)."""
        record = {
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "ingredients": self.ingredients,
            "target": planner.target_cost.probe_timings,
            "draft": planner.draft_cost.probe_timings,
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".probe-", suffix=".json")
            with os.fdopen(fd, "w") as out:
                json.dump(record, out)
            os.replace(temporary, self.path)
        except OSError as exc:
            logger.warning("start-up probe not recorded at %s: %s", self.path, exc)


def _files(model: str | None) -> Any:
    """A model folder's files (name, size, modification time); a hub name as it is."""
    if not model or not os.path.isdir(model):
        return model
    entries = sorted(os.scandir(model), key=lambda e: e.name)
    return [model] + [[e.name, e.stat().st_size, e.stat().st_mtime_ns] for e in entries if e.is_file()]


def _machine() -> dict[str, Any]:
    cpu: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "flags") and key.strip() not in cpu:
                    cpu[key.strip()] = value.strip()
    except OSError:
        pass
    try:
        version = metadata.version("specprefill")
    except metadata.PackageNotFoundError:
        version = None
    cuda = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "platform": platform.platform(),
        "processor": cpu.get("model name") or platform.processor(),
        "flags": hashlib.sha256(cpu.get("flags", "").encode()).hexdigest()[:16],
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": cuda,
        "specprefill": version,
    }

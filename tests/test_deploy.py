"""docker/ and compose.yaml, checked statically (no Docker engine runs here)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from gateway.settings import GatewaySettings
from specprefill_vllm import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _env(service: dict) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def test_services_and_healthchecks(compose):
    services = compose["services"]
    assert {"redis", "vllm", "draft-worker", "gateway", "tgi", "gateway-text"} <= services.keys()
    for name, service in services.items():
        assert "test" in service.get("healthcheck", {}), f"{name} has no healthcheck"


def test_images_are_pinned(compose):
    for name, service in compose["services"].items():
        image = service.get("image", "")
        assert image and not image.endswith(":latest") and re.search(r":\d", image), f"{name}: {image!r}"
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("FROM "):
                assert re.search(r":v?\d+\.\d+", line) and "latest" not in line, line


def test_gpu_reservations(compose):
    for name in ("vllm", "draft-worker", "tgi"):
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "deploy" not in compose["services"]["gateway"]  # the gateway needs no GPU


def test_gateway_wiring(compose):
    services = compose["services"]
    env = _env(services["gateway"])
    assert env["SPECPREFILL_BACKEND_URL"] == "http://vllm:8000" and env["SPECPREFILL_BACKEND_KIND"] == "vllm"
    assert env["SPECPREFILL_REDIS_URL"].startswith("redis://redis:")
    assert "draft-worker:8002" in env["SPECPREFILL_DRAFT_WORKER_URL"]
    assert set(services["gateway"]["depends_on"]) == {"redis", "vllm", "draft-worker"}
    text_env = _env(services["gateway-text"])
    assert text_env["SPECPREFILL_BACKEND_KIND"] == "text" and services["gateway-text"]["profiles"] == ["tgi"]
    assert services["vllm"]["environment"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_every_gateway_variable_is_a_setting(compose, monkeypatch):
    """The variables compose sets are ones the gateway reads, and their values parse."""
    fields = {f"SPECPREFILL_{name.upper()}" for name in GatewaySettings.model_fields}
    env = _env(compose["services"]["gateway"])
    for key, value in env.items():
        if key.startswith("SPECPREFILL_"):
            assert key in fields, key
            monkeypatch.setenv(
                key, re.sub(r"\$\{[^}:]+:-([^}]*)\}", r"\1", value).replace("${TARGET_MODEL:?set TARGET_MODEL}", "m")
            )
    settings = GatewaySettings()
    assert settings.draft_worker_url == ["http://draft-worker:8002"] and settings.backend_kind == "vllm"


def test_the_vllm_image_matches_the_plugin(compose):
    dockerfile = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    tag = re.search(r"FROM vllm/vllm-openai:v(\S+)", dockerfile).group(1)
    assert tag.startswith(SUPPORTED_VLLM) and "pip install --no-cache-dir /opt/specprefill-vllm" in dockerfile
    assert tag in compose["services"]["vllm"]["image"]


def test_the_image_copies_every_package_it_installs():
    """``pip install .`` in the image sees only what the Dockerfile copies; a package left out breaks the image."""
    includes = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.split(".")[0].rstrip("*") for p in includes}
    assert packages == {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests"}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / "docker" / "specprefill.Dockerfile").read_text(), re.M))
    assert packages <= copied, packages - copied


def test_the_products_wheel_holds_no_lab(tmp_path):
    """``pip install .`` at the root installs the product alone: the gateway, the draft worker, the engine,
    ``common`` and the commands users run, without the lab's modules, its trained pairs or its dependencies."""
    source = tmp_path / "source"
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.split():
        if name.split("/")[0] in {
            "pyproject.toml",
            "README.md",
            "common",
            "draft_worker",
            "engine",
            "gateway",
            "specprefill",
        }:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*pip, str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("specprefill_gateway-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {n.split("/")[0] for n in names if not n.startswith("specprefill_gateway-")} == {
        "common",
        "draft_worker",
        "engine",
        "gateway",
        "specprefill",
    }
    assert not [n for n in names if "lab" in n.split("/")[0] or "/data/" in n or n.endswith((".safetensors", ".jsonl"))]
    required = {
        re.split(r"[ ;<>=\[]", line.removeprefix("Requires-Dist: "))[0]
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    assert not required & {"tqdm", "matplotlib", "specprefill-lab"}, required
    lab_only = []
    for path in (ROOT / p for p in listed.split() if p.endswith(".py")):
        if path.relative_to(ROOT).parts[0] in {"common", "draft_worker", "engine", "gateway", "specprefill"}:
            if re.search(r"^\s*(from|import) (tqdm|matplotlib|specprefill_lab)\b", path.read_text(), re.M):
                lab_only.append(path)
    assert not lab_only, lab_only


def test_the_vllm_command_gives_what_the_planner_reads(compose):
    """Prefix caching (what the planner plans around), cached-token counts in every answer (what its cost models
    learn from), and a scheduling policy vLLM knows (priority lets a request overtake a waiting warming piece)."""
    command = compose["services"]["vllm"]["command"]
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(command)
    policy = command[command.index("--scheduling-policy") + 1]
    assert re.sub(r"\$\{[^}:]+:-([^}]*)\}", r"\1", policy) in ("fcfs", "priority")
    # an agent's tools (a Messages request with tools asks for automatic tool choice), as the README starts vLLM
    assert "--enable-auto-tool-choice" in command
    assert re.sub(r"\$\{[^}:]+:-([^}]*)\}", r"\1", command[command.index("--tool-call-parser") + 1]) == "llama3_json"


def test_the_gateway_follows_vllms_kv_events(compose):
    """vLLM publishes its KV cache events where the gateway subscribes (its replay socket too)."""
    command = compose["services"]["vllm"]["command"]
    config = json.loads(command[command.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] and config["publisher"] == "zmq"
    env = _env(compose["services"]["gateway"])
    for setting, key in (
        ("SPECPREFILL_BACKEND_KV_EVENTS", "endpoint"),
        ("SPECPREFILL_BACKEND_KV_EVENTS_REPLAY", "replay_endpoint"),
    ):
        assert env[setting] == config[key].replace("*", "vllm")

"""The tree is the architecture: imports run down the layers, and no module imports itself round a circle.

Every import counts: module-level, inside functions, and type-only ones under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# bottom to top; units in one layer are peers and never import each other
LAYERS = [
    ("common",),
    ("draft_worker", "engine"),
    ("gateway",),
    ("specprefill.real_models",),
    ("specprefill",),
    ("specprefill_lab",),  # its own distribution (lab/): it imports the product; the product never imports it
    ("benchmarks",),
]
APART = ("specprefill_vllm",)  # its own distribution: imports nothing of ours, and nothing of ours imports it
SOURCES = {
    "common": "common",
    "draft_worker": "draft_worker",
    "engine": "engine",
    "gateway": "gateway",
    "specprefill": "specprefill",
    "specprefill_lab": "lab/specprefill_lab",
    "benchmarks": "lab/benchmarks",
    "specprefill_vllm": "vllm_plugin/specprefill_vllm",
}


def module_name(path: Path, package_root: Path, package: str) -> str:
    parts = [package, *path.relative_to(package_root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in SOURCES.items():
        root = ROOT / folder
        for path in sorted(root.rglob("*.py")):
            modules[module_name(path, root, package)] = path
    return modules


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def unit_of(module: str) -> str:
    units = [u for layer in LAYERS for u in layer] + list(APART)
    return max((u for u in units if module == u or module.startswith(u + ".")), key=len)


def rank(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that runs up a layer, sideways between peers, or into or out of the plugin."""
    found = []
    for module, targets in graph.items():
        for target in sorted(targets):
            source_unit, target_unit = unit_of(module), unit_of(target)
            if source_unit == target_unit:
                continue
            if source_unit in APART or target_unit in APART or rank(target_unit) >= rank(source_unit):
                found.append(f"{module} imports {target} ({source_unit} may not import {target_unit})")
    return found


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def test_imports_run_down_the_layers(graph):
    assert len(graph) > 50 and graph["gateway.serving"]  # the walk found the project
    assert violations(graph) == []


def test_no_import_circles(graph):
    assert circle(graph) is None


# the gateway's floors, in the order a request passes them read from the bottom: the engines as the gateway knows
# them, planning, dispatch, the shared prologue, the API surfaces, the app; its settings, metrics and the
# builder (``wiring``) stand beside them
GATEWAY_FLOORS = [
    "gateway.engines",
    "gateway.planning",
    "gateway.dispatch",
    "gateway.serving",
    "gateway.entrypoints",
    "gateway.app",
]


def floor_of(module: str) -> int | None:
    return next((i for i, f in enumerate(GATEWAY_FLOORS) if module == f or module.startswith(f + ".")), None)


def gateway_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import in the gateway that runs up a floor."""
    found = []
    for module, targets in graph.items():
        here = floor_of(module)
        for target in sorted(targets):
            there = floor_of(target)
            if here is not None and there is not None and there > here:
                found.append(f"{module} imports {target} ({GATEWAY_FLOORS[here]} is below {GATEWAY_FLOORS[there]})")
    return found


def test_the_gateway_reads_as_its_floors(graph):
    assert {floor_of(m) for m in graph if m.startswith("gateway.")} >= set(range(len(GATEWAY_FLOORS)))
    assert gateway_violations(graph) == []
    assert gateway_violations({"gateway.engines.replicas": {"gateway.planning.warming"}})


def test_the_checks_catch_what_they_look_for():
    upward = {"common.errors": {"gateway.app"}, "gateway.app": set()}
    sideways = {"engine.engine": {"draft_worker.worker"}, "draft_worker.worker": set()}
    lab_from_below = {"gateway.app": {"specprefill_lab.demo_models"}, "specprefill_lab.demo_models": set()}
    into_plugin = {"gateway.app": {"specprefill_vllm.patches"}, "specprefill_vllm.patches": set()}
    lab_from_the_command = {"specprefill.cli": {"specprefill_lab.eval"}, "specprefill_lab.eval": set()}
    for bad in (upward, sideways, lab_from_below, into_plugin, lab_from_the_command):
        assert violations(bad), bad
    assert violations({"specprefill_lab.eval": {"specprefill.cli", "gateway.app", "common.errors"}}) == []
    assert circle({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}) is not None
    assert circle({"a.x": {"a.y"}, "a.y": set()}) is None


def test_type_only_and_function_level_imports_count(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.app import x\n"
        "def f():\n    from specprefill.cli import main\n"
    )
    assert imports_of("common.m", source, {"gateway.app", "specprefill.cli"}) == {"gateway.app", "specprefill.cli"}


def test_importing_every_module_registers_nothing():
    """No import-time side effects: custom attention kernels are registered when a model is prepared."""
    modules = [
        m for m in project_modules() if not m.startswith(("benchmarks", "specprefill_vllm", "specprefill.__main__"))
    ]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "from transformers import AttentionInterface\n"
        "print(sorted(k for k in AttentionInterface._global_mapping if 'specprefill' in k))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_gateway_settings_import_nothing_of_the_gateway_above_them():
    """The settings are the gateway's floor: every part reads them, so they read no part (the cost models' terms
    live beneath both, in ``gateway.cost_terms``)."""
    modules = project_modules()
    mine = imports_of("gateway.settings", modules["gateway.settings"], set(modules))
    assert {m for m in mine if m.startswith("gateway.")} <= {"gateway.cost_terms"}, mine

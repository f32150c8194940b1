"""The code is uniform: ``ruff check`` (pyflakes, pycodestyle, import order) and ``ruff format`` find nothing
(settings in pyproject.toml; ruff's version is pinned there, since another one formats differently); mypy,
strict, finds nothing in ``gateway/`` and ``common/``; and no function outside the tests is longer than a
screen."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"  # make install installs it
MYPY = shutil.which("mypy", path=str(Path(sys.executable).parent)) or "mypy"


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_finds_nothing(command):
    result = subprocess.run([RUFF, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_mypy_strict_finds_nothing():
    """Settings in pyproject.toml: strict on every product package (``gateway/``, ``common/``, ``engine/``,
    ``draft_worker/``, the vLLM plugin), the lab and the commands read for their types."""
    result = subprocess.run([MYPY], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


LONGEST = 60  # lines of one function, its signature and docstring included
SOURCES = ("common", "draft_worker", "engine", "gateway", "specprefill", "lab", "vllm_plugin", "scripts")


def test_no_function_is_longer_than_a_screen():
    long = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > LONGEST:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these functions:\n" + "\n".join(long)

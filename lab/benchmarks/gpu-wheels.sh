#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its image has torch, transformers, accelerate, numpy, httpx, aiohttp,
# jinja2, tqdm, pytest ...; no registry), downloaded here into .whl/ for Python 3.12 at the versions this .venv
# runs; lab/benchmarks/gpu.sh installs them into /tmp/site there. Name .whl in the device call's carry (7-8 MB).
#   bash lab/benchmarks/gpu-wheels.sh [.whl]
set -euo pipefail
DEST=${1:-.whl}
PIP=${PIP:-.venv/bin/pip}
# the gateway's and the tests' own needs, and theirs, that the GPU image (2026-11) does not hold
NAMES="fastapi starlette uvicorn pydantic pydantic_core pydantic-settings python-dotenv typing-inspection
annotated-types redis pyzmq lm-format-enforcer interegular gguf openai jiter sniffio httpx2 httpcore2
truststore opentelemetry-api pytest-asyncio"
mkdir -p "$DEST"
grep -qx "/$DEST/" .git/info/exclude 2>/dev/null || echo "/$DEST/" >>.git/info/exclude
for name in $NAMES; do
    version=$("$PIP" show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    [ -n "$version" ] || { echo "gpu-wheels: $name is not installed here" >&2; exit 1; }
    "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$name==$version" 2>&1 | grep -v "WARNING: Location" || true
done
du -sh "$DEST"

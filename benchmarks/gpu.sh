#!/usr/bin/env bash
# The README's GPU section in one go, on a machine with a CUDA GPU (no network needed):
#   bash benchmarks/gpu.sh OUT [scorer] [sweep] [workloads]      (default: all three)
# Makes a Llama-3.2-1B-shaped draft and a Llama-3.1-8B-shaped target with random bf16 weights (the demo
# tokenizer; `specprefill demo-models --draft-shape/--target-shape`), once, in $PAIR, then:
#   scorer     benchmarks/bench_scorer.py at 8k/16k/32k: scoring vs a plain prefill, time and peak memory
#   sweep      specprefill bench: TTFT through the gateway vs direct at 8k-32k, keep 0.1/0.3/0.5, the ideal
#   workloads  specprefill bench --workloads: repeated contexts (issue 13's five workloads); WORKLOAD_FLAGS adds
#              flags (--shared-engine: one engine for both paths)
# Python packages the machine lacks may be dropped as wheels in .whl/ (installed into /tmp/site).
set -euo pipefail
OUT=${1:?usage: bash benchmarks/gpu.sh OUT [scorer] [sweep] [workloads]}
shift
STEPS=${*:-scorer sweep workloads}
PAIR=${PAIR:-/tmp/specprefill-gpu-pair}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
if compgen -G ".whl/*.whl" >/dev/null && ! "$PYTHON" -c "import fastapi" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
"$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
if [ ! -f "$PAIR/demo.json" ]; then
    time "$PYTHON" -m specprefill demo-models "$PAIR" --draft-shape llama-3.2-1b --target-shape llama-3.1-8b
fi
for step in $STEPS; do
    echo "== $step $(date +%T)"
    case $step in
        scorer) "$PYTHON" benchmarks/bench_scorer.py --model "$PAIR/draft" --device cuda \
                    --lengths 8192 16384 32768 --repeats 5 --json "$OUT/scorer.json" ;;
        sweep) "$PYTHON" -m specprefill bench --pair "$PAIR" --lengths "${LENGTHS:-8192,16384,32768}" \
                    --keep-rates 0.1,0.3,0.5,1.0 --repeats "${REPEATS:-3}" --out "$OUT/sweep" ;;
        workloads) "$PYTHON" -m specprefill bench --pair "$PAIR" --workloads --workload-tokens "${WORKLOAD_TOKENS:-16000}" \
                    --workload-requests "${WORKLOAD_REQUESTS:-5}" --out "$OUT/workloads" ${WORKLOAD_FLAGS:-} ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
echo "== done $(date +%T)"

#!/usr/bin/env bash
# The GPU results in one go, on a machine with a CUDA GPU (no network needed):
#   bash lab/benchmarks/gpu.sh OUT [tests] [attention] [regime] [rounds] [scorer] [sweep] [workloads] [real]
#   (default: tests attention regime rounds, about 9 minutes on an H200)
#
#   tests      the GPU tests (the flash kernel's chunked prefill, CUDA graphs, float32 products)
#   attention  lab/benchmarks/bench_attention.py: one prefill chunk's attention over 8k-128k cached tokens, with the
#              end-aligned mask as before and as the flash kernel's lower-right causal form
#   regime     the paper's regime: a 32B-class target (Qwen2.5-32B's shape, random bf16 weights made at load:
#              `specprefill demo-models --no-weights`) on the reference engine, a Llama-3.2-1B-shaped draft in
#              the gateway, both on the GPU and one engine for both paths (`specprefill engine`, `specprefill
#              serve`, as a deployment starts them). Then, against that stack:
#                the cold sweep, one `specprefill bench` per length (REGIME_LENGTHS, default 65536 131072 32768;
#                keep REGIME_KEEPS) so that each length's JSON is kept whatever comes after it, then merged into
#                one table and plot (`bench merge`, in regime-sweep/);
#                Poisson mixed sessions (`bench workloads --arrivals poisson --shared-engine`: POISSON_RATES
#                sessions/s, POISSON_SESSIONS each, POISSON_TOKENS-token contexts, keep POISSON_KEEP)
#   rounds     lab/benchmarks/loadtest.py: ROUNDS rounds of ROUND_STREAMS streams (the gateway's own cost on the CPU
#              cores, the instant backend), after the GPU stack is gone
#   scorer, sweep, workloads: the 2026-11-24 tables at Llama-3.2-1B / Llama-3.1-8B shapes (weights written in $PAIR)
#   real       the real model's quality table (`specprefill eval --real`) with every draft, REAL_PARALLEL gateways
#              at a time on the GPU, lengths in REAL_LENGTHS' order, capped at REAL_CAP_S (answers.jsonl keeps what
#              finished; a later run resumes it). The GGUF file is REAL_GGUF, or REAL_PARTS joined (a device run
#              carries at most 64 MiB: the 94 MiB file goes in two calls); REAL_HAYSTACKS (gzipped or not) are
#              the haystacks a run here wrote, so that this machine's Python asks the same prose
#              (with them, the committed answers, REAL_RESUME, seed answers.jsonl: only what they lack is asked)
#
# Each step has a time cap (STEP_CAP_S, and the sweep's and Poisson's own): a step over it is stopped and the next
# one runs. With PACK=FILE, OUT is packed into that tar.gz after every step (a device run gets only a few files
# back, and keeps what finished if it is stopped). Python packages the machine lacks may be dropped as wheels in
# .whl/ (installed into /tmp/site): `bash lab/benchmarks/gpu-wheels.sh` downloads them here (the tests step needs
# pytest-asyncio among them: the project's pytest settings fail on its options without it).
set -uo pipefail
OUT=${1:?usage: bash lab/benchmarks/gpu.sh OUT [tests] [attention] [regime] [rounds] [scorer] [sweep] [workloads]}
shift
STEPS=${*:-tests attention regime rounds}
PAIR=${PAIR:-/tmp/specprefill-gpu-pair}
REGIME_PAIR=${REGIME_PAIR:-/tmp/specprefill-gpu-regime}
REGIME_DRAFT=${REGIME_DRAFT:-llama-3.2-1b}
REGIME_TARGET=${REGIME_TARGET:-qwen2.5-32b}
REGIME_LENGTHS=${REGIME_LENGTHS:-65536 131072 32768}
REGIME_KEEPS=${REGIME_KEEPS:-0.05,0.1,0.3}
REGIME_REPEATS=${REGIME_REPEATS:-1}
SWEEP_CAP_S=${SWEEP_CAP_S:-240}
POISSON_RATES=${POISSON_RATES:-0.5,1,2,3}
POISSON_SESSIONS=${POISSON_SESSIONS:-12}
POISSON_TOKENS=${POISSON_TOKENS:-8000}
POISSON_KEEP=${POISSON_KEEP:-0.1}
POISSON_CAP_S=${POISSON_CAP_S:-220}
ROUNDS=${ROUNDS:-5}
ROUND_STREAMS=${ROUND_STREAMS:-100}
ROUND_S=${ROUND_S:-4}
STEP_CAP_S=${STEP_CAP_S:-150}
REAL_GGUF=${REAL_GGUF:-/tmp/specprefill-real.gguf}
REAL_PARTS=${REAL_PARTS:-}
REAL_HAYSTACKS=${REAL_HAYSTACKS:-}
REAL_LENGTHS=${REAL_LENGTHS:-7000,4000,2000}
# answers already asked on the haystacks written here: with REAL_HAYSTACKS, only what they lack is asked
REAL_RESUME=${REAL_RESUME:-$(ls docs/results/data/real-eval-{7k,gpu,4k,2k}-answers.jsonl 2>/dev/null)}
REAL_SAMPLES=${REAL_SAMPLES:-50}
REAL_PARALLEL=${REAL_PARALLEL:-9}
REAL_CAP_S=${REAL_CAP_S:-480}
REAL_DEVICE=${REAL_DEVICE:-cuda}
REAL_DRAFTS=${REAL_DRAFTS:-target,self-4,self-8,self-12,cross,random,head,tail,self-8/w16}  # self-8/w16: make serve's
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
if compgen -G ".whl/*.whl" >/dev/null && ! "$PYTHON" -c "import fastapi" 2>/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
STARTED=$SECONDS

stamp() { echo "== $* $(date +%T) (+$((SECONDS - STARTED)) s)"; }
pack() { [ -n "${PACK:-}" ] && tar czf "$PACK.tmp" -C "$OUT" . && mv "$PACK.tmp" "$PACK"; return 0; }

wait_health() {  # URL PID SECONDS: until URL/health answers 200, the process dies, or the time is up
    "$PYTHON" - "$@" <<'EOF'
import sys, time, os, httpx
url, pid, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        if httpx.get(f"{url}/health", timeout=5).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"{url}: the process {pid} ended before it answered")
    time.sleep(0.5)
sys.exit(f"{url}: no answer in {limit:.0f} s")
EOF
}

regime() {
    if [ ! -f "$REGIME_PAIR/demo.json" ]; then
        "$PYTHON" -m specprefill demo-models "$REGIME_PAIR" --draft-shape "$REGIME_DRAFT" \
            --target-shape "$REGIME_TARGET" --no-weights --max-positions 262144 --device cpu || return 1
    fi
    cp "$REGIME_PAIR/demo.json" "$OUT/regime-pair.json"
    local engine=http://127.0.0.1:18001 gateway=http://127.0.0.1:18000 events
    events='{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:18557", "replay_endpoint": "tcp://*:18558"}'
    stamp "regime: engine ($REGIME_PAIR/target)"
    "$PYTHON" -m specprefill engine --model "$REGIME_PAIR/target" --port 18001 --served-model-name specprefill-demo \
        --kv-events-config "$events" --log-level warning >"$OUT/regime-engine.log" 2>&1 &
    local engine_pid=$!
    wait_health $engine $engine_pid 240 || { kill $engine_pid; return 1; }
    stamp "regime: gateway ($REGIME_PAIR/draft)"
    "$PYTHON" -m specprefill serve --port 18000 --backend-url $engine --backend-kind reference \
        --target-model "$REGIME_PAIR/target" --draft-model "$REGIME_PAIR/draft" --served-model-name specprefill-demo \
        --min-prompt-tokens 1024 --log-level warning >"$OUT/regime-gateway.log" 2>&1 &
    local gateway_pid=$!
    wait_health $gateway $gateway_pid 240 || { kill $gateway_pid $engine_pid; return 1; }
    nvidia-smi --query-gpu=memory.used --format=csv >>"$OUT/device.txt" 2>/dev/null
    for length in $REGIME_LENGTHS; do
        stamp "regime: sweep at $length tokens"
        timeout -k 10 "$SWEEP_CAP_S" "$PYTHON" -m specprefill bench sweep --base-url $gateway --backend-url $engine \
            --lengths "$length" --keep-rates "$REGIME_KEEPS" --repeats "$REGIME_REPEATS" --no-warmup-direct \
            --out "$OUT/regime-$length" || echo "regime: the sweep at $length stopped ($?)"
        nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$OUT/device.txt" 2>/dev/null
        pack
    done
    local swept
    swept=$(ls "$OUT"/regime-[0-9]*/bench.json 2>/dev/null | paste -sd,)
    [ -n "$swept" ] && "$PYTHON" -m specprefill bench merge "$swept" --out "$OUT/regime-sweep"
    stamp "regime: Poisson mixed sessions"
    timeout -k 10 "$POISSON_CAP_S" "$PYTHON" -m specprefill bench workloads --base-url $gateway --backend-url $engine \
        --arrivals poisson --shared-engine --session-rates "$POISSON_RATES" \
        --sessions-per-rate "$POISSON_SESSIONS" --tokens "$POISSON_TOKENS" \
        --keep-rate "$POISSON_KEEP" --out "$OUT/regime-poisson" || echo "regime: Poisson stopped ($?)"
    kill $gateway_pid $engine_pid
    wait $gateway_pid $engine_pid 2>/dev/null
    return 0
}

real() {
    if [ ! -f "$REAL_GGUF" ]; then
        [ -n "$REAL_PARTS" ] || { echo "real: no $REAL_GGUF and no REAL_PARTS" >&2; return 1; }
        cat $REAL_PARTS >"$REAL_GGUF.tmp" && mv "$REAL_GGUF.tmp" "$REAL_GGUF" || return 1
    fi
    sha256sum "$REAL_GGUF" | tee -a "$OUT/device.txt"
    local haystacks=$REAL_HAYSTACKS
    if [[ "$haystacks" == *.gz ]]; then gunzip -c "$haystacks" >/tmp/specprefill-haystacks.jsonl; haystacks=/tmp/specprefill-haystacks.jsonl; fi
    export SPECPREFILL_REAL_GGUF=$REAL_GGUF SPECPREFILL_CACHE_DIR=${SPECPREFILL_CACHE_DIR:-/tmp/specprefill-cache}
    "$PYTHON" -m specprefill real-model || return 1
    mkdir -p "$OUT/real"
    if [ -n "$haystacks" ] && [ -n "$REAL_RESUME" ] && [ ! -s "$OUT/real/answers.jsonl" ]; then
        cat $REAL_RESUME >"$OUT/real/answers.jsonl"
    fi
    stamp "real: the quality table"
    timeout -k 10 "$REAL_CAP_S" "$PYTHON" -m specprefill eval --real --real-device "$REAL_DEVICE" \
        --real-parallel "$REAL_PARALLEL" ${haystacks:+--real-haystacks "$haystacks"} --real-lengths "$REAL_LENGTHS" \
        --real-samples "$REAL_SAMPLES" --real-keep-rates 0.3,0.1,0.05 --real-windows 16 --real-drafts "$REAL_DRAFTS" \
        --out "$OUT/real" >"$OUT/real.txt" 2>&1
    local status=$?
    echo "real: $(wc -l <"$OUT/real/answers.jsonl") answers (exit $status)"
    rm -f "$OUT/real/haystacks.jsonl"  # the same as the ones sent
    return 0
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/device.txt"
"$PYTHON" -c "import os, torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'cpus', os.cpu_count())" | tee -a "$OUT/device.txt"
for step in $STEPS; do
    stamp "$step"
    case $step in
        tests) timeout -k 10 "$STEP_CAP_S" "$PYTHON" -m pytest -q -p no:cacheprovider tests/common/test_attention.py \
                   tests/draft_worker/test_graphs.py 2>&1 | tee "$OUT/tests.txt" ;;
        real) real ;;
        attention) timeout -k 10 "$STEP_CAP_S" "$PYTHON" lab/benchmarks/bench_attention.py --json "$OUT/attention.json" ;;
        regime) regime ;;
        rounds) timeout -k 10 "$STEP_CAP_S" "$PYTHON" lab/benchmarks/loadtest.py --concurrency "$ROUND_STREAMS" \
                    --rounds "$ROUNDS" --duration "$ROUND_S" --out "$OUT/rounds.json" 2>&1 | tee "$OUT/rounds.txt" ;;
        scorer|sweep|workloads)
            if [ ! -f "$PAIR/demo.json" ]; then
                "$PYTHON" -m specprefill demo-models "$PAIR" --draft-shape llama-3.2-1b --target-shape llama-3.1-8b
            fi
            case $step in
                scorer) "$PYTHON" lab/benchmarks/bench_scorer.py --model "$PAIR/draft" --device cuda \
                            --lengths 8192 16384 32768 --repeats 5 --json "$OUT/scorer.json" ;;
                sweep) "$PYTHON" -m specprefill bench sweep --pair "$PAIR" --lengths "${LENGTHS:-8192,16384,32768}" \
                           --keep-rates 0.1,0.3,0.5,1.0 --repeats "${REPEATS:-3}" --out "$OUT/sweep" ;;
                workloads) "$PYTHON" -m specprefill bench workloads --pair "$PAIR" \
                               --tokens "${WORKLOAD_TOKENS:-16000}" \
                               --requests "${WORKLOAD_REQUESTS:-5}" --out "$OUT/workloads" \
                               ${WORKLOAD_FLAGS:-} ;;
            esac ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    pack
done
stamp done

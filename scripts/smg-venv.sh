#!/usr/bin/env bash
# SGLang's model gateway (smg 1.13.0, a Rust binary on PyPI) in a side venv: the gateway in front of
# two vLLM workers in the live tier (tests/providers/test_vllm_live.py) and the gateway benchmark
# (openalice_runner/bench/gateway_affinity.py). The runner never imports it; it runs `smg launch`.
#
#   scripts/smg-venv.sh            # build or reuse; prints the binary's path last
#
# Where: ${OPENALICE_SMG_VENV:-${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}/venvs/smg};
# the binary is its bin/smg (OPENALICE_SMG names another). Idempotent: a venv whose smg prints
# version 1.13.0 is reused.
set -euo pipefail
SMG_VERSION=1.13.0
CACHE_DIR="${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}"
VENV="${OPENALICE_SMG_VENV:-$CACHE_DIR/venvs/smg}"
PYTHON="${PYTHON:-python3}"
if [ "$("$VENV/bin/smg" --version 2>/dev/null)" = "smg $SMG_VERSION" ]; then
    echo "reused $VENV"
else
    echo "building the smg venv at $VENV (smg $SMG_VERSION)"
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q "smg==$SMG_VERSION"
    [ "$("$VENV/bin/smg" --version)" = "smg $SMG_VERSION" ]
fi
echo "$VENV/bin/smg"

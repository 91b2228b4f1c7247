#!/usr/bin/env bash
# Side venv for the SGLang contract tier: SGLang 0.5.23's own code (installed --no-deps) plus what
# importing its OpenAI protocol classes (sglang/srt/entrypoints/openai/protocol.py) and its
# ServerArgs parser needs, and nothing of the GPU stack beyond a CPU torch. The runner never
# imports SGLang: tests/providers/test_sglang_contract.py and tests/policies/test_sglang_flags.py run this venv's
# python in a subprocess and skip, saying so, without it.
#
#   scripts/sglang-contract-venv.sh [VENV_DIR]          # default /tmp/sglang-contract
#   export OPENALICE_SGLANG_VENV=/tmp/sglang-contract
#   pytest tests/providers/test_sglang_contract.py tests/policies/test_sglang_flags.py
#
# SGLang imports torch at package import (sglang/srt/utils/common.py). A torch already installed in
# the project's venv (OPENALICE_HOST_PYTHON, default .venv/bin/python) is reused through a .pth
# file that comes after the side venv's own packages; otherwise a CPU torch is installed.
set -euo pipefail
SGLANG_VERSION=0.5.23
VENV=${1:-/tmp/sglang-contract}
HOST_PY=${OPENALICE_HOST_PYTHON:-.venv/bin/python}

python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q)
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
# protocol.py: pydantic, openai (sglang 0.5.23 pins openai==2.8.0), msgspec; the package import
# (sglang/__init__.py -> srt/utils/common.py) and server_args.py: the rest.
"${PIP[@]}" "openai==2.8.0" pydantic msgspec numpy orjson psutil pybase64 requests packaging pillow \
    starlette pyzmq ipython triton
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -x "$HOST_PY" ] && "$HOST_PY" -c 'import torch' 2>/dev/null; then
    "$HOST_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' >"$SITE/zz_host_torch.pth"
else
    "${PIP[@]}" torch --index-url https://download.pytorch.org/whl/cpu
fi
"$VENV/bin/python" - <<'PY'
import sglang
from sglang.srt.entrypoints.openai.protocol import ChatCompletionResponse, ChatCompletionStreamResponse  # noqa: F401
from sglang.srt.server_args import ServerArgs  # noqa: F401
print(f"sglang {sglang.__version__}: protocol classes and ServerArgs import")
PY
echo "export OPENALICE_SGLANG_VENV=$VENV"

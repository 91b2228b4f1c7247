"""Helpers for tests that run real server processes on loopback."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None, timeout: float = 60.0, log: Path | None = None) -> None:
    """Until `url` answers 200. `proc` exiting first is a RuntimeError (with the end of its `log`), and
    past `timeout` a TimeoutError, `proc` killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = f": {log.read_text()[-2000:]}" if log is not None else ""
            raise RuntimeError(f"process exited with {proc.returncode}{tail}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    if proc is not None:
        proc.kill()
    raise TimeoutError(url)

"""Issue 46's probe, as a real `serve` process: SIGHUP drains as SIGTERM does (16b), and a providers
file replaced by a FIFO or a link to /dev/zero neither blocks the watcher nor the exit (14)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from support.serve_process import TINY, Serve

ROUTES = "routes:\n  - {name: default, chain: [local]}\n"


def test_sighup_drains_like_sigterm(tmp_path):
    trace = tmp_path / "trace.jsonl"
    serve = Serve(tmp_path, TINY + ROUTES, "--trace-file", str(trace), "--shutdown-grace", "60", gated=True)
    events: list[str] = []
    refused: list[httpx.Response] = []
    serve.gate.touch()  # the stream holds after its first pass until the probe below has its 503
    try:
        with httpx.stream(
            "POST", f"{serve.url}/v1/chat/completions", timeout=120,
            json={"messages": [{"role": "user", "content": "go on"}], "max_tokens": 60, "stream": True,
                  "stream_options": {"include_usage": True}},
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            serve.proc.send_signal(signal.SIGHUP)  # mid-stream

            def probe() -> None:
                try:
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        try:
                            answer = httpx.get(f"{serve.url}/health", timeout=1)
                            if answer.status_code == 503:
                                refused.append(answer)
                                return
                        except httpx.HTTPError:
                            pass
                        time.sleep(0.05)
                finally:
                    serve.gate.unlink()

            prober = threading.Thread(target=probe)
            prober.start()
            events += [line[6:] for line in lines if line.startswith("data: ")]
        prober.join(30)
        assert serve.proc.wait(timeout=60) == 0  # drained and exited by itself, not killed by the signal
    finally:
        if serve.proc.poll() is None:
            serve.terminate()
    assert refused and refused[0].json()["error"]["code"] == "server_shutting_down"
    assert events[-1] == "[DONE]"  # the stream in flight finished whole
    spans = [json.loads(x) for x in trace.read_text().splitlines()]
    assert any(s["attributes"].get("gen_ai.operation.name") == "chat" for s in spans)  # flushed


def _providers_status(serve: Serve) -> dict:
    return httpx.get(f"{serve.url}/health", timeout=5).json()["providers"]


def _wait_for(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_a_fifo_or_dev_zero_as_providers_file_is_refused_and_sigterm_still_exits(tmp_path):
    serve = Serve(tmp_path, TINY + ROUTES)
    providers = tmp_path / "providers.yaml"
    try:
        providers.unlink()
        os.mkfifo(providers)  # nobody ever writes it: an open() without O_NONBLOCK waits forever
        _wait_for(lambda: "last_error" in _providers_status(serve), "the FIFO was not reported")
        assert "not a regular file" in _providers_status(serve)["last_error"]
        providers.unlink()
        providers.symlink_to("/dev/zero")  # st_size 0, endless to read
        _wait_for(lambda: "character device" in serve.log(), "the link to /dev/zero was not reported")
        providers.unlink()
        providers.write_text(TINY + "routes:\n  - {name: again, chain: [local]}\n")  # a valid edit applies
        _wait_for(lambda: "last_error" not in _providers_status(serve), "the valid edit did not apply")
        assert "providers file reloaded" in serve.log()
        providers.unlink()
        os.mkfifo(providers)
        _wait_for(lambda: "last_error" in _providers_status(serve), "the FIFO was not reported")
        assert serve.terminate(timeout=30) == 0  # the watcher is not stuck in open(): the process exits
    finally:
        if serve.proc.poll() is None:
            serve.terminate()

"""`openalice-runner serve` as a real process: SIGTERM with a request in flight, a trace collector that
is down, and no secret in logs, traces or error bodies."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from support.serve_process import TINY, Serve

from server.test_upstream_faults import PROVIDER_KEY, key_echo_app
from tests.stand_ins.serve import ServerThread, refused_url

SERVER_KEY = "oa-server-secret-5b1c9e7d2a"
CONTENT = "CONTENT-MARKER-7f3a91"


def test_sigterm_lets_the_request_in_flight_finish_refuses_new_ones_and_flushes(tmp_path):
    trace = tmp_path / "trace.jsonl"
    serve = Serve(
        tmp_path, TINY + "routes:\n  - {name: default, chain: [local]}\n",
        "--trace-file", str(trace), "--shutdown-grace", "60", gated=True,
    )  # fmt: skip
    events: list[str] = []
    refused: list[httpx.Response] = []
    refused_at: list[float] = []
    serve.gate.touch()  # the stream's generation holds after its first pass until the probe is answered
    try:
        with httpx.stream(
            "POST", f"{serve.url}/v1/chat/completions", timeout=120,
            json={"messages": [{"role": "user", "content": "go on"}], "max_tokens": 120, "stream": True,
                  "stream_options": {"include_usage": True}},
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            serve.proc.send_signal(signal.SIGTERM)  # mid-stream

            def probe() -> None:  # new requests are answered 503 while the stream still runs (issue 34)
                try:
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        try:
                            r = httpx.get(f"{serve.url}/health", timeout=1)
                            if r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down":
                                refused.append(r)
                                refused_at.append(time.monotonic())
                                return
                        except httpx.HTTPError:
                            pass
                        time.sleep(0.05)
                finally:
                    serve.gate.unlink()  # let the stream finish, answered or not

            prober = threading.Thread(target=probe)
            prober.start()
            events += [line[6:] for line in lines if line.startswith("data: ")]
            finished_at = time.monotonic()
        prober.join(30)
        assert serve.terminate() == 0
    finally:
        if serve.proc.poll() is None:
            serve.terminate()
    assert events[-1] == "[DONE]"  # the stream in flight finished whole
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] > 0
    assert refused_at and refused_at[0] < finished_at, "new requests were still served"
    assert refused[0].headers["retry-after"] == "1"
    spans = [json.loads(x) for x in trace.read_text().splitlines()]
    chats = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "chat"]
    assert (
        len(chats) == 1 and chats[0]["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    )


def test_trace_collector_down_costs_spans_counted_as_dropped_not_requests(tmp_path):
    serve = Serve(
        tmp_path, TINY + "routes:\n  - {name: default, chain: [local]}\n", "--trace-exporter", "otlp",
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": refused_url(), "OTEL_EXPORTER_OTLP_TIMEOUT": "1"},
    )  # fmt: skip
    try:
        for i in range(3):
            t0 = time.monotonic()
            r = httpx.post(
                f"{serve.url}/v1/chat/completions", timeout=60,
                json={"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2},
            )  # fmt: skip
            assert r.status_code == 200 and time.monotonic() - t0 < 20
        deadline = time.monotonic() + 30
        dropped = 0.0
        while time.monotonic() < deadline and dropped == 0:
            for line in httpx.get(f"{serve.url}/metrics", timeout=5).text.splitlines():
                if line.startswith('openalice_trace_spans_dropped_total{reason="export_failed"}'):
                    dropped = float(line.rsplit(" ", 1)[1])
            time.sleep(0.5)
        assert dropped >= 3  # the turn and chat spans of the requests, at least
        t0 = time.monotonic()
        assert serve.terminate(timeout=60) == 0
        assert time.monotonic() - t0 < 30  # the flush gives up on a dead collector, it does not hang
    finally:
        if serve.proc.poll() is None:
            serve.terminate()


@pytest.fixture
def echo_upstream():
    server = ServerThread(key_echo_app()).start()
    yield server
    server.stop()


def test_no_secret_in_logs_traces_or_error_bodies(tmp_path, echo_upstream):
    trace = tmp_path / "trace.jsonl"
    providers = TINY + (
        f"  echo: {{type: hosted, model: openai/stand-in, api_base: '{echo_upstream.url}/v1',"
        " api_key_env: FAULT_KEY, max_retries: 0}\n"
        "routes:\n  - {name: echo, match: {turn_types: [echo]}, chain: [echo]}\n"
        "  - {name: default, chain: [local]}\n"
    )
    serve = Serve(
        tmp_path, providers, "--trace-file", str(trace), "--log-level", "debug",
        env={"OPENALICE_API_KEY": SERVER_KEY, "FAULT_KEY": PROVIDER_KEY},
    )  # fmt: skip
    url = f"{serve.url}/v1/chat/completions"
    good = {"Authorization": f"Bearer {SERVER_KEY}"}
    bodies: list[str] = []
    try:
        msg = [{"role": "user", "content": f"please keep {CONTENT} private"}]
        cases = [
            (httpx.post(url, json={"messages": msg}, timeout=60), 401),
            (httpx.post(url, json={"messages": msg}, headers={"Authorization": f"Bearer {PROVIDER_KEY}"}), 401),
            (httpx.post(url, json={"messages": msg, "max_tokens": 3}, headers=good, timeout=60), 200),
            (httpx.post(url, json={"messages": msg}, headers={**good, "X-OpenAlice-Turn-Type": "echo"},
                        timeout=60), 401),
            (httpx.post(url, json={"messages": msg, "max_tokens": "lots"}, headers=good), 400),
            (httpx.post(url, content=b"{oops", headers={**good, "Content-Type": "application/json"}), 400),
        ]  # fmt: skip
        for response, status in cases:
            assert response.status_code == status, response.text
            bodies.append(response.text)
        assert serve.terminate() == 0
    finally:
        if serve.proc.poll() is None:
            serve.terminate()
    log, spans = serve.log(), trace.read_text()
    assert "[REDACTED]" in spans  # the upstream's echo of the key reached the trace, masked
    for secret in (SERVER_KEY, PROVIDER_KEY):
        for where, text in (("log", log), ("trace", spans), *(("body", b) for b in bodies)):
            assert secret not in text, f"{where} leaks a secret"
    # Message content stays out of traces unless --record-content.
    assert CONTENT not in spans
    assert any(
        json.loads(line)["attributes"].get("gen_ai.operation.name") == "chat" for line in spans.splitlines()
    )


def test_serve_binds_loopback_by_default():
    from openalice_runner.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"

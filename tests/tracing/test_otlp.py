"""`serve` exporting over OTLP/HTTP to a loopback receiver that parses what it gets as the
collector would (protobuf `ExportTraceServiceRequest`), with the standard OTEL_* variables:

- OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER choose the exporters (`none` pushes nothing);
- the generic endpoint gets `/v1/traces` appended, a per-signal endpoint is used as it is;
- a traces-only collector (405 on /v1/metrics, as Arize Phoenix answers) does not hold SIGTERM;
- without a `traceparent`, a request's HTTP server span and its `invoke_agent` span share a trace,
  the turn a child of the server span.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from locations import REPO
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from stand_ins.processes import free_port, wait_http

API_KEY = "otlp-key"


SHUTDOWN_BOUND_S = 10.0


class Receiver:
    """OTLP/HTTP on 127.0.0.1: traces accepted and parsed; every other path answers 405."""

    def __init__(self, traces_path: str = "/v1/traces") -> None:
        self.traces_path = traces_path
        self.posts: list[str] = []
        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.posts.append(self.path)
                if self.path != receiver.traces_path:
                    self.send_response(405)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend(scope_spans.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _serve(tmp: Path, env: dict[str, str], *extra: str) -> tuple[subprocess.Popen, str]:
    providers = tmp / "providers.yaml"
    providers.write_text(
        "providers:\n  local: {type: local, tiny_random: true, max_tokens_default: 4}\n"
        "routes:\n  - {name: default, chain: [local]}\n"
    )
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env = {**clean, "HF_HUB_OFFLINE": "1", "OPENALICE_API_KEY": API_KEY, "PYTHONPATH": str(REPO),
           "OTEL_METRIC_EXPORT_INTERVAL": "300", **env}  # fmt: skip
    cmd = [sys.executable, "-m", "openalice_runner", "serve", "--port", str(port), "--providers", str(providers),
           "--policy", str(REPO / "policies" / "default.yaml"), *extra]  # fmt: skip
    log = (tmp / "serve.log").open("wb")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc, timeout=180)  # a loaded shared machine starts slowly
    return proc, url


def _chat(url: str, **headers: str) -> None:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}", **headers},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def _stop(proc: subprocess.Popen) -> float:
    """SIGTERM; seconds until the process exited (killed past 30 s)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - t0


def _until(done, timeout: float = 60.0) -> None:
    """Poll `done` until it holds; the deadline is generous (a loaded shared machine is slow)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def _turns_under_server_spans(spans) -> int:
    by_id = {s.span_id: s for s in spans}
    turns = [s for s in spans if s.name.startswith("invoke_agent")]
    assert turns
    for turn in turns:
        parent = by_id.get(turn.parent_span_id)
        assert parent is not None, "invoke_agent has no parent in the export"
        assert parent.kind == parent.SPAN_KIND_SERVER and parent.trace_id == turn.trace_id
    return len(turns)


def test_traces_only_collector_does_not_hold_shutdown_and_spans_share_a_trace(tmp_path):
    receiver = Receiver()
    try:
        proc, url = _serve(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}, "--trace-exporter", "otlp")
        _chat(url)
        _chat(url, **{"X-OpenAlice-Conversation-Id": "c-1", "X-OpenAlice-Turn-Type": "chat"})
        _until(lambda: "/v1/metrics" in receiver.posts)  # a metric export hit the 405 before SIGTERM
        took = _stop(proc)
        assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-2000:]
        assert took < SHUTDOWN_BOUND_S, f"SIGTERM took {took:.1f} s"
        assert "/v1/metrics" in receiver.posts  # the default still pushes metrics: they were refused
        assert _turns_under_server_spans(receiver.spans) == 2
    finally:
        receiver.close()


def test_env_chooses_exporters_and_per_signal_endpoint_is_used_as_is(tmp_path):
    receiver = Receiver(traces_path="/collector/traces")
    try:
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/collector/traces",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,  # metrics would go to /v1/metrics
        }
        proc, url = _serve(tmp_path, env)
        _chat(url)
        # no wait: the shutdown flushes every exporter there is, so a metrics exporter would post now
        took = _stop(proc)
        assert proc.returncode == 0
        assert took < SHUTDOWN_BOUND_S
        assert set(receiver.posts) == {"/collector/traces"}  # no metrics pushed
        assert _turns_under_server_spans(receiver.spans) == 1
    finally:
        receiver.close()


def test_unknown_exporter_variable_is_refused_naming_it(tmp_path):
    providers = tmp_path / "providers.yaml"
    providers.write_text("providers:\n  local: {type: local, tiny_random: true}\n"
                         "routes:\n  - {name: default, chain: [local]}\n")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OTEL_METRICS_EXPORTER": "zipkin"}
    r = subprocess.run([sys.executable, "-m", "openalice_runner", "serve", "--providers", str(providers)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2
    assert "OTEL_METRICS_EXPORTER" in r.stderr and "zipkin" in r.stderr



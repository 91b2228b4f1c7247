"""Issue 46's probe of `serve`, the server's findings: a client-chosen `model` that grew /metrics and
memory (10), a huge body rendered before the context check (11), keys and request text in the trace
file and a trace file without a cap (15), deep history arguments answered 500 (16a) and a stream
whose deadline did not hold while a send blocked (16c). Real HTTP on loopback; the embedded engine's
tiny random model, or a scripted provider where the test needs a stream that never ends."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import stat
import threading
import time

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stand_ins.engines import tiny_engine
from stand_ins.scripted import ScriptedProvider, scripted_runner

from openalice_runner.providers.config import load_routing_text
from openalice_runner.providers.streams import chat_stream
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.tracing.jsonl import JsonLinesSpanExporter
from openalice_runner.types import ChatChunk, new_id
from tests.test_server_api import LiveServer

HI = [{"role": "user", "content": "hi"}]
KEY = "probe-key-46-9d1e"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 4}
routes:
  - {name: default, match: {models: ["*"]}, chain: [local]}
"""


class Stack:
    """The app over the tiny engine, its spans (FastAPI's server span included) kept in memory."""

    def __init__(self, runner: Runner | None = None, *, record_content: bool = False) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        reader = InMemoryMetricReader()
        telemetry = RunnerTelemetry(
            self.tracer_provider, MeterProvider(metric_readers=[reader]), record_content=record_content
        )
        self.runner = runner or Runner.from_config(
            providers=load_routing_text(PROVIDERS), policy=False, telemetry=telemetry, engine=tiny_engine()
        )
        if runner is not None:
            runner.telemetry = telemetry
        self.metrics = ServerMetrics(otel_reader=reader)
        app = create_app(
            self.runner, telemetry=telemetry, settings=ServerSettings(api_key=KEY), metrics=self.metrics,
            tracer_provider=self.tracer_provider,
        )  # fmt: skip
        self.server = LiveServer(app).start()
        self.url = self.server.url

    def post(self, body, headers=None, timeout=60) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers={**AUTH, **(headers or {})},
                          timeout=timeout)  # fmt: skip

    def span_text(self) -> str:
        return json.dumps([{"name": s.name, "attributes": dict(s.attributes or {})}
                           for s in self.spans.get_finished_spans()], default=str)  # fmt: skip


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.server.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    return r.json()["error"]


# ---- 15: no key, query string or stop string in spans without --record-content; a capped trace file


def test_server_span_keeps_no_query_string_and_no_raw_path(stack):
    stack.spans.clear()
    assert httpx.get(f"{stack.url}/v1/models?api_key={KEY}", timeout=30).status_code == 401
    assert httpx.get(f"{stack.url}/v1/models/{KEY}", timeout=30).status_code == 401
    assert httpx.get(f"{stack.url}/v1/models/{KEY}x", headers=AUTH, timeout=30).status_code == 404
    assert httpx.get(f"{stack.url}/elsewhere/{KEY}", headers=AUTH, timeout=30).status_code == 404
    servers = [s for s in stack.spans.get_finished_spans() if s.kind.name == "SERVER"]
    assert len(servers) == 4  # the server spans are there, redacted
    assert KEY not in stack.span_text()
    paths = [s.attributes.get("url.path") for s in servers]
    assert paths == ["/v1/models", "/v1/models/{id}", "/v1/models/{id}", "other"]
    assert not any("url.query" in s.attributes for s in servers)


def test_stop_strings_reach_spans_only_with_record_content(stack):
    stop = "STOP-MARKER-46"
    stack.spans.clear()
    assert stack.post({"messages": HI, "max_tokens": 2, "stop": [stop]}).status_code == 200
    assert "gen_ai.operation.name" in stack.span_text()  # the chat span is there
    assert stop not in stack.span_text()
    recording = Stack(record_content=True)
    try:
        assert recording.post({"messages": HI, "max_tokens": 2, "stop": [stop]}).status_code == 200
        assert stop in recording.span_text()
    finally:
        recording.server.stop()


def test_trace_file_is_capped_and_rotated_once_owner_only(tmp_path):
    path = tmp_path / "trace.jsonl"
    exporter = JsonLinesSpanExporter(path, max_bytes=4096)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for i in range(200):  # ~200 bytes a span: several rotations
        tracer.start_span(f"span-{i}", attributes={"i": i}).end()
    exporter.force_flush()
    rotated = tmp_path / "trace.jsonl.1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl", "trace.jsonl.1"]
    for p in (path, rotated):
        assert p.stat().st_size <= 4096
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    names = [json.loads(line)["name"] for p in (rotated, path) for line in p.read_text().splitlines()]
    assert names[-1] == "span-199" and names == [f"span-{i}" for i in range(200 - len(names), 200)]
    big = "x" * 5000  # a span larger than the cap on its own is left out and counted
    tracer.start_span("huge", attributes={"big": big}).end()
    assert exporter.oversized == 1 and path.stat().st_size <= 4096
    exporter.shutdown()

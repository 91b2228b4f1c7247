"""Application-side telemetry: exporters (file, OTLP over real HTTP), bounded queue with a drop counter,
structlog lines carrying trace ids."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import structlog
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.tracing.jsonl import read_spans
from openalice_runner.tracing.setup import (
    DropCounter,
    _CountingBatchSpanProcessor,
    _CountingExporter,
    configure_logging,
    configure_telemetry,
)


def _turn(telemetry: RunnerTelemetry) -> None:
    with telemetry.turn_span("alice", "c1", "tool_call") as turn:
        turn.add_event("planned", {"n": 1})
        with telemetry.tool_span("search", "call_9", step=2, turn_type="tool_call"):
            pass
        with pytest.raises(RuntimeError), telemetry.tool_span("broken", "call_10", step=3):
            raise RuntimeError("tool failed")


def test_file_exporter_writes_one_json_object_per_span(tmp_path):
    path = tmp_path / "trace.jsonl"
    providers = configure_telemetry("file", str(path), set_global=False)
    _turn(RunnerTelemetry(providers.tracer_provider, providers.meter_provider))
    providers.shutdown()  # flushes the batch queue

    spans = {s["name"]: s for s in read_spans(path)}
    assert set(spans) == {"invoke_agent alice", "execute_tool search", "execute_tool broken"}
    turn, tool, broken = (
        spans["invoke_agent alice"],
        spans["execute_tool search"],
        spans["execute_tool broken"],
    )
    assert turn["parent_id"] is None and len(turn["trace_id"]) == 32 and len(turn["span_id"]) == 16
    assert tool["parent_id"] == turn["span_id"] and tool["trace_id"] == turn["trace_id"]
    assert tool["kind"] == "INTERNAL"
    assert tool["attributes"]["gen_ai.tool.call.id"] == "call_9"
    assert tool["attributes"]["openalice.step"] == 2
    assert turn["start_ns"] <= tool["start_ns"] <= tool["end_ns"] <= turn["end_ns"]
    assert turn["events"] == [
        {"name": "planned", "time_ns": turn["events"][0]["time_ns"], "attributes": {"n": 1}}
    ]
    assert broken["status"]["code"] == "ERROR" and broken["attributes"]["error.type"] == "RuntimeError"
    assert turn["status"]["code"] == "UNSET"
    assert turn["service"] == "openalice-runner"
    assert providers.drops.total == 0


def test_trace_file_reader_skips_a_torn_last_line_only(tmp_path):
    good = json.dumps({"name": "a", "span_id": "1"})
    torn = tmp_path / "torn.jsonl"
    torn.write_text(f'{good}\n{good}\n{{"name": "b", "spa')
    assert len(list(read_spans(torn))) == 2
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text(f"{good}\nnot json\n{good}\n")
    with pytest.raises(ValueError, match="corrupt.jsonl:2"):
        list(read_spans(corrupt))


class _BlockingExporter(SpanExporter):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.release.wait(10)
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


def test_full_queue_drops_spans_and_counts_them():
    from opentelemetry.sdk.trace import TracerProvider

    drops = DropCounter()
    exporter = _BlockingExporter()
    processor = _CountingBatchSpanProcessor(
        _CountingExporter(exporter, drops),
        drops,
        max_queue_size=8,
        max_export_batch_size=4,
        schedule_delay_millis=1,
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    for i in range(100):
        tracer.start_span(f"s{i}").end()
    exporter.release.set()
    provider.shutdown()
    assert drops.counts["queue_full"] > 0
    # Nothing vanishes unaccounted: every span was either exported or counted as dropped.
    assert exporter.exported + drops.counts["queue_full"] == 100


class _FailingExporter(SpanExporter):
    def export(self, spans):
        return SpanExportResult.FAILURE


def test_failed_exports_are_counted():
    from opentelemetry.sdk.trace import TracerProvider

    drops = DropCounter()
    provider = TracerProvider()
    provider.add_span_processor(
        _CountingBatchSpanProcessor(
            _CountingExporter(_FailingExporter(), drops), drops, max_queue_size=64, max_export_batch_size=16
        )
    )
    for i in range(5):
        provider.get_tracer("t").start_span(f"s{i}").end()
    provider.shutdown()
    assert drops.counts["export_failed"] == 5


class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, bytes]] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Collector.received.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_otlp_http_export_to_a_real_receiver(monkeypatch):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    server = HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Collector.received = []
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        providers = configure_telemetry("otlp", set_global=False)
        _turn(RunnerTelemetry(providers.tracer_provider, providers.meter_provider))
        providers.shutdown()
    finally:
        server.shutdown()
    traces = [body for path, body in _Collector.received if path == "/v1/traces"]
    assert traces, [p for p, _ in _Collector.received]
    names = set()
    for body in traces:
        request = ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                names |= {s.name for s in ss.spans}
    assert names == {"invoke_agent alice", "execute_tool search", "execute_tool broken"}
    assert any(path == "/v1/metrics" for path, _ in _Collector.received)  # metrics go the same way


def test_otlp_collector_down_counts_drops_and_does_not_hang(monkeypatch):
    from tests.stand_ins.serve import refused_url

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{refused_url()}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", f"{refused_url()}/v1/metrics")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    providers = configure_telemetry("otlp", set_global=False)
    _turn(RunnerTelemetry(providers.tracer_provider, providers.meter_provider))
    t0 = time.monotonic()
    providers.shutdown()
    assert time.monotonic() - t0 < 15
    assert providers.drops.counts["export_failed"] == 3


def test_unknown_exporter_and_file_without_path_are_errors():
    with pytest.raises(ValueError, match="exporter must be one of"):
        configure_telemetry("jaeger", set_global=False)
    with pytest.raises(ValueError, match="trace_file"):
        configure_telemetry("file", set_global=False)


def test_json_logs_carry_the_current_trace_and_span_ids(restore_logging, capsys):
    from opentelemetry.sdk.trace import TracerProvider

    configure_logging(json_logs=True)
    telemetry = RunnerTelemetry(TracerProvider())
    log = structlog.get_logger("test")
    log.info("outside")
    with telemetry.turn_span("alice") as turn:
        log.info("inside", answer=42)
        logging.getLogger("uvicorn.error").info("stdlib inside")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    by_event = {x["event"]: x for x in lines}
    ctx = turn.get_span_context()
    assert "trace_id" not in by_event["outside"]
    for event in ("inside", "stdlib inside"):
        assert by_event[event]["trace_id"] == format(ctx.trace_id, "032x")
        assert by_event[event]["span_id"] == format(ctx.span_id, "016x")
    assert by_event["inside"]["answer"] == 42 and by_event["inside"]["level"] == "info"

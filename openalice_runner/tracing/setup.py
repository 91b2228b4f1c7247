"""Telemetry setup for applications (CLI, server) only; library code never calls this.

configure_telemetry() builds a TracerProvider and a MeterProvider with the chosen span exporter:
  none     spans are still created (parents, trace ids for logs) but nothing is exported
  console  one JSON block per span on stdout (the SDK's ConsoleSpanExporter)
  file     a JSON-lines trace file (tracing/jsonl.py), what `trace report` reads
  otlp     OTLP over HTTP; endpoint, headers, timeout from the standard OTEL_EXPORTER_OTLP_* variables
Spans go through a BatchSpanProcessor with a bounded queue; what it cannot keep is counted, not hidden.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from openalice_runner.redaction import redact
from openalice_runner.tracing.telemetry import current_trace_ids

ExporterName = Literal["none", "console", "file", "otlp"]
EXPORTERS: tuple[str, ...] = ("none", "console", "file", "otlp")
SERVICE_NAME = "openalice-runner"


class DropCounter:
    """Spans lost on the way out, by reason: queue_full (the processor's bounded queue overflowed) or
    export_failed (collector down, disk full).

    Drops are derived from spans in and out (ended - handed to the exporter - still queued) rather than
    from the SDK's own drop signal, which can count a drop that a concurrent export made room for.
    Exact whenever the queue is quiet; kept monotonic in between."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ended = 0
        self.handed = 0  # spans passed to the exporter, successfully or not
        self.failed = 0
        self.queued: Any = lambda: 0
        self._queue_full_peak = 0

    def span_ended(self) -> None:
        with self._lock:
            self.ended += 1

    def handed_over(self, n: int, ok: bool) -> None:
        with self._lock:
            self.handed += n
            if not ok:
                self.failed += n

    @property
    def counts(self) -> dict[str, int]:
        with self._lock:
            lost = self.ended - self.handed - self.queued()
            self._queue_full_peak = max(self._queue_full_peak, lost)
            return {"queue_full": self._queue_full_peak, "export_failed": self.failed}

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class _CountingExporter(SpanExporter):
    """Counts spans whose export failed (collector down, disk full) and never raises into the worker."""

    def __init__(self, inner: SpanExporter, drops: DropCounter) -> None:
        self.inner, self.drops = inner, drops

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # an exporter bug must not kill the batch worker
            result = SpanExportResult.FAILURE
        self.drops.handed_over(len(spans), ok=result is SpanExportResult.SUCCESS)
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()


class _CountingBatchSpanProcessor(BatchSpanProcessor):
    """BatchSpanProcessor that counts the spans it is given, so that DropCounter can tell what it lost."""

    def __init__(
        self, exporter: SpanExporter, drops: DropCounter, max_queue_size: int, **kwargs: Any
    ) -> None:
        super().__init__(exporter, max_queue_size=max_queue_size, **kwargs)
        self._drops = drops
        # The queue is private to the SDK (1.4x keeps it here); without it, drops show once it drains.
        queue = getattr(getattr(self, "_batch_processor", None), "_queue", None)
        if queue is not None:
            drops.queued = lambda: len(queue)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self._drops.span_ended()
        super().on_end(span)


@dataclass
class TelemetryProviders:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    exporter: str
    drops: DropCounter = field(default_factory=DropCounter)
    trace_file: str | None = None

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        ok = self.tracer_provider.force_flush(timeout_millis)
        return self.meter_provider.force_flush(timeout_millis) and ok

    def shutdown(self) -> None:
        """Flush and stop: spans still queued are written before this returns."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def _span_exporter(exporter: str, trace_file: str | None) -> SpanExporter | None:
    if exporter == "none":
        return None
    if exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if exporter == "file":
        if not trace_file:
            raise ValueError("exporter 'file' needs trace_file")
        from openalice_runner.tracing.jsonl import JsonLinesSpanExporter

        return JsonLinesSpanExporter(trace_file)
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT/HEADERS/TIMEOUT
    raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")


def configure_telemetry(
    exporter: ExporterName | str = "none",
    trace_file: str | None = None,
    *,
    metric_readers: Sequence[MetricReader] = (),
    max_queue_size: int = 4096,
    schedule_delay_millis: float = 500,
    set_global: bool = True,
) -> TelemetryProviders:
    """Build tracer and meter providers for an application. `set_global` installs them as the global
    providers (the server and CLI do; tests usually pass False and hand the providers over explicitly)."""
    resource = Resource.create(
        {"service.name": SERVICE_NAME}
    )  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win
    tracer_provider = TracerProvider(resource=resource)
    drops = DropCounter()
    span_exporter = _span_exporter(exporter, trace_file)
    if span_exporter is not None:
        tracer_provider.add_span_processor(
            _CountingBatchSpanProcessor(
                _CountingExporter(span_exporter, drops),
                drops,
                max_queue_size=max_queue_size,
                max_export_batch_size=min(512, max_queue_size),
                schedule_delay_millis=schedule_delay_millis,
            )
        )
    readers = list(metric_readers)
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    # No exemplars: nothing here reads them, and sampling them costs every histogram record.
    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, exemplar_filter=AlwaysOffExemplarFilter()
    )
    if set_global:
        trace.set_tracer_provider(tracer_provider)
        otel_metrics.set_meter_provider(meter_provider)
    return TelemetryProviders(tracer_provider, meter_provider, exporter, drops, trace_file)


# ---- logs -----------------------------------------------------------------------------------------


def _add_trace_ids(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    ids = current_trace_ids()
    if ids is not None:
        event.setdefault("trace_id", ids[0])
        event.setdefault("span_id", ids[1])
    return event


def _redact_event(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """Keys out of log lines (upstream messages and tracebacks can carry them)."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redact(value)
    return event


def configure_logging(json_logs: bool = True, level: str = "info") -> None:
    """structlog for the application: JSON lines (server) or console text, each line carrying the current
    trace_id and span_id. Standard-library loggers (uvicorn, litellm) go through the same renderer."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_ids,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            _redact_event,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
        # an earlier uvicorn.Config in this process may have set a level or disabled the logger
        lg.setLevel(logging.NOTSET)
        lg.disabled = False

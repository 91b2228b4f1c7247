"""Telemetry setup for applications (CLI, server) only; library code never calls this.

configure_telemetry() builds a TracerProvider and a MeterProvider with the chosen span exporter:
  none     spans are still created (parents, trace ids for logs) but nothing is exported
  console  one JSON block per span on stdout (the SDK's ConsoleSpanExporter)
  file     a JSON-lines trace file (tracing/jsonl.py), what `trace report` reads
  otlp     OTLP over HTTP; endpoint, headers, timeout from the standard OTEL_EXPORTER_OTLP_* variables
           (the generic endpoint gets /v1/traces or /v1/metrics appended, a per-signal one is used as is)
Metrics are pushed over OTLP only with metrics exporter `otlp` (`exporters_from_env`: OTEL_METRICS_EXPORTER,
by default `otlp` where spans go over OTLP); the /metrics scrape is there either way.
Spans go through a BatchSpanProcessor with a bounded queue; what it cannot keep is counted, not hidden.
Flush and shutdown are bounded (`FLUSH_BOUND_S`, `SHUTDOWN_BOUND_S`): a collector that refuses or does
not answer costs exports, never a stuck shutdown.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import MutableMapping, Sequence
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
# OTEL_METRICS_EXPORTER: `prometheus` is the /metrics endpoint, which is always served: nothing to push
METRIC_EXPORTERS: tuple[str, ...] = ("none", "otlp", "console", "prometheus")
SERVICE_NAME = "openalice-runner"
EXPORT_TIMEOUT_S = 5.0  # one OTLP export, retries included, unless OTEL_EXPORTER_OTLP_*TIMEOUT says otherwise
FLUSH_BOUND_S = 3.0  # the server's flush at shutdown, then the providers' shutdown: 7 s at most
SHUTDOWN_BOUND_S = 4.0

logger = logging.getLogger(__name__)


def exporters_from_env(cli_exporter: str | None, trace_file: str | None) -> tuple[str, str]:
    """(span exporter, metrics exporter) for an application: the CLI's choice, else OTEL_TRACES_EXPORTER,
    else `file` with a trace file, else `none`; OTEL_METRICS_EXPORTER, else `otlp` where spans go over
    OTLP (a collector usually takes both), else `none`. ValueError naming the variable for other values."""
    traces = cli_exporter or _env_choice("OTEL_TRACES_EXPORTER", EXPORTERS) or ("file" if trace_file else "none")
    metrics = _env_choice("OTEL_METRICS_EXPORTER", METRIC_EXPORTERS) or ("otlp" if traces == "otlp" else "none")
    return traces, metrics


def _env_choice(name: str, allowed: tuple[str, ...]) -> str | None:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw not in allowed:
        raise ValueError(f"{name}={raw!r} is not supported; use one of {', '.join(allowed)}")
    return raw


def _export_timeout(signal: str) -> float:
    """The OTLP exporter's own timeout (its retries stop at it): the standard variables where set."""
    for name in (f"OTEL_EXPORTER_OTLP_{signal}_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        raw = os.environ.get(name)
        if raw:
            try:
                return float(raw)
            except ValueError:
                raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    return EXPORT_TIMEOUT_S


def _bounded(what: str, work: Any, bound_s: float) -> bool:
    """Run `work` on a daemon thread and wait at most `bound_s` for it: an exporter stuck on a collector
    must not hold the process. False (and a warning) where it did not finish in time."""
    done = threading.Event()

    def run() -> None:
        try:
            work()
        except Exception:  # telemetry must not break the shutdown it is part of
            logger.warning("telemetry %s failed", what, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name=f"telemetry-{what}", daemon=True).start()
    if done.wait(bound_s):
        return True
    logger.warning("telemetry %s did not finish within %.0f s; going on without it", what, bound_s)
    return False


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

    def force_flush(self, timeout_millis: int = int(FLUSH_BOUND_S * 1000)) -> bool:
        """Push what is queued, within `timeout_millis` in all."""
        results: list[bool] = []

        def flush() -> None:
            results.append(self.tracer_provider.force_flush(timeout_millis))
            results.append(self.meter_provider.force_flush(timeout_millis))

        return _bounded("flush", flush, timeout_millis / 1000) and all(results)

    def shutdown(self, bound_s: float = SHUTDOWN_BOUND_S) -> None:
        """Flush and stop: spans still queued are written before this returns, unless the exporters take
        longer than `bound_s` (a collector that does not answer)."""

        def stop() -> None:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown(timeout_millis=bound_s * 1000)

        _bounded("shutdown", stop, bound_s)


def _span_exporter(exporter: str, trace_file: str | None, trace_file_max_bytes: int | None = None) -> SpanExporter | None:
    if exporter == "none":
        return None
    if exporter == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if exporter == "file":
        if not trace_file:
            raise ValueError("exporter 'file' needs trace_file")
        from openalice_runner.tracing.jsonl import DEFAULT_MAX_BYTES, JsonLinesSpanExporter

        return JsonLinesSpanExporter(trace_file, trace_file_max_bytes or DEFAULT_MAX_BYTES)
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # reads OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT/HEADERS
        return OTLPSpanExporter(timeout=_export_timeout("TRACES"))
    raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")


def configure_telemetry(
    exporter: ExporterName | str = "none",
    trace_file: str | None = None,
    *,
    metric_readers: Sequence[MetricReader] = (),
    max_queue_size: int = 4096,
    schedule_delay_millis: float = 500,
    set_global: bool = True,
    metrics_exporter: str | None = None,
    trace_file_max_bytes: int | None = None,
) -> TelemetryProviders:
    """Build tracer and meter providers for an application. `set_global` installs them as the global
    providers (the server and CLI do; tests usually pass False and hand the providers over explicitly).
    `metrics_exporter`: one of METRIC_EXPORTERS (None: `otlp` where `exporter` is, else `none`).
    `trace_file_max_bytes`: the trace file's cap before it rotates (None: tracing/jsonl.py's default)."""
    if metrics_exporter is None:
        metrics_exporter = "otlp" if exporter == "otlp" else "none"
    if metrics_exporter not in METRIC_EXPORTERS:
        raise ValueError(f"metrics exporter must be one of {METRIC_EXPORTERS}, got {metrics_exporter!r}")
    resource = Resource.create(
        {"service.name": SERVICE_NAME}
    )  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win
    # No SDK exit hooks: they shut the providers down again at interpreter exit, unbounded (a span
    # processor joins its worker while it retries a collector); TelemetryProviders.shutdown is bounded.
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    drops = DropCounter()
    span_exporter = _span_exporter(exporter, trace_file, trace_file_max_bytes)
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
    if metrics_exporter in ("otlp", "console"):
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

        if metrics_exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            timeout = _export_timeout("METRICS")
            metric_exporter: Any = OTLPMetricExporter(timeout=timeout)
        else:
            timeout, metric_exporter = EXPORT_TIMEOUT_S, ConsoleMetricExporter()
        # interval from OTEL_METRIC_EXPORT_INTERVAL; one export never runs past the exporter's timeout
        readers.append(PeriodicExportingMetricReader(metric_exporter, export_timeout_millis=timeout * 1000))
    # No exemplars: nothing here reads them, and sampling them costs every histogram record.
    meter_provider = MeterProvider(
        resource=resource, metric_readers=readers, exemplar_filter=AlwaysOffExemplarFilter(), shutdown_on_exit=False
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


def _redact_event(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
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

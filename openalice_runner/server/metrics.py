"""/metrics: Prometheus text from the server's own registry (never the process-global one).

Two sources:
- HTTP-level counters and histograms kept here with prometheus_client;
- the OpenTelemetry GenAI metrics RunnerTelemetry records (gen_ai.client.operation.duration, token usage,
  time to first chunk, accepted length, tokens/s), read from an in-memory OTel reader at scrape time and
  rendered as Prometheus histograms (dots become underscores, unit "s" becomes the _seconds suffix).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics.export import Histogram as OtelHistogram
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    NumberDataPoint,
    Sum,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from openalice_runner.server.runner_protocol import ServedRunner

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_UNIT_SUFFIX = {"s": "_seconds", "ms": "_milliseconds", "By": "_bytes"}


def _prom_name(name: str, unit: str | None) -> str:
    base = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    suffix = _UNIT_SUFFIX.get(unit or "", "")
    return base if not suffix or base.endswith(suffix) else base + suffix


def _label_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class OtelBridge(Collector):
    """Renders the OTel SDK's cumulative metrics (from an InMemoryMetricReader) at each scrape."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        self.reader = reader

    def collect(self) -> Iterator[Any]:
        data = self.reader.get_metrics_data()
        if data is None:
            return
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    yield from self._family(metric)

    def _family(self, metric: Any) -> Iterator[Any]:
        name = _prom_name(metric.name, metric.unit)
        points = list(metric.data.data_points)
        if not points:
            return
        keys = sorted({k for p in points for k in (p.attributes or {})})
        labels = [_label_name(k) for k in keys]
        if isinstance(metric.data, OtelHistogram):
            histogram = HistogramMetricFamily(name, metric.description or metric.name, labels=labels)
            for p in points:
                assert isinstance(p, HistogramDataPoint)
                values = [str((p.attributes or {}).get(k, "")) for k in keys]
                cumulative, buckets = 0, []
                for bound, count in zip(p.explicit_bounds, p.bucket_counts, strict=False):
                    cumulative += count
                    buckets.append((_fmt_bound(bound), cumulative))
                buckets.append(("+Inf", p.count))
                histogram.add_metric(values, buckets, p.sum)
            yield histogram
        elif isinstance(metric.data, Sum) and metric.data.is_monotonic:
            counter = CounterMetricFamily(name, metric.description or metric.name, labels=labels)
            for p in points:
                assert isinstance(p, NumberDataPoint)
                counter.add_metric([str((p.attributes or {}).get(k, "")) for k in keys], p.value)
            yield counter
        else:
            gauge = GaugeMetricFamily(name, metric.description or metric.name, labels=labels)
            for p in points:
                gauge.add_metric([str((p.attributes or {}).get(k, "")) for k in keys], getattr(p, "value", 0))
            yield gauge


def _fmt_bound(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


class _DroppedSpans(Collector):
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Any]:
        fam = CounterMetricFamily(
            "openalice_trace_spans_dropped",
            "Spans lost on the way to the exporter, by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(self.counts().items()):
            fam.add_metric([reason], n)
        yield fam


class _RunnerState(Collector):
    """Admission gates and embedded-engine memory, read from the runner at scrape time."""

    def __init__(self, runner: ServedRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Any]:
        gates = self.runner.gates
        families = {
            "in_flight": GaugeMetricFamily(
                "openalice_provider_requests_in_flight",
                "Requests holding a provider's slots.",
                labels=["provider"],
            ),
            "queued": GaugeMetricFamily(
                "openalice_provider_requests_queued",
                "Requests waiting for a provider's slot.",
                labels=["provider"],
            ),
            "max_in_flight": GaugeMetricFamily(
                "openalice_provider_max_in_flight",
                "Slots per provider (admission limit).",
                labels=["provider"],
            ),
            "max_queue": GaugeMetricFamily(
                "openalice_provider_max_queue",
                "Queue bound per provider (admission limit).",
                labels=["provider"],
            ),
        }
        refused = CounterMetricFamily(
            "openalice_provider_requests_refused",
            "Requests refused at once because a provider's slots and queue were full (429).",
            labels=["provider"],
        )
        for name, gate in sorted(gates.items()):
            stats = gate.stats()
            for key, family in families.items():
                family.add_metric([name], getattr(stats, key))
            refused.add_metric([name], stats.refused)
        yield from families.values()
        yield refused
        kv = GaugeMetricFamily(
            "openalice_engine_kv_tokens_in_use",
            "KV cache positions held by running generations of the embedded engine (0 when idle).",
            labels=["provider"],
        )
        for name, provider in sorted(self.runner.providers.items()):
            value = provider.kv_tokens_in_use
            if value is not None:
                kv.add_metric([name], value)
        yield kv


class ServerMetrics:
    def __init__(
        self,
        otel_reader: InMemoryMetricReader | None = None,
        dropped_spans: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "openalice_http_requests",
            "HTTP requests answered, by route and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_duration = Histogram(
            "openalice_http_request_duration_seconds", "HTTP request time (to the last byte).", ["route"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.chat_completions = Counter(
            "openalice_chat_completions",
            "Chat completion requests, by turn type, streaming and outcome "
            "(ok, error, refused, deadline, cancelled).",
            ["turn_type", "stream", "outcome"],
            registry=r,
        )
        self.in_flight = Gauge(
            "openalice_requests_in_flight", "Chat completions being served now.", registry=r
        )
        self.open_turns = Gauge(
            "openalice_open_turns", "Agent turns waiting for their next step.", registry=r
        )
        self.ttft = Histogram(
            "openalice_time_to_first_token_seconds", "Time from request to first streamed token.", ["turn_type"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "openalice_tokens", "Tokens processed, by type (input, output).", ["type"], registry=r
        )
        self.tenant_requests = Counter(
            "openalice_tenant_requests",
            "Requests with a key, by tenant (`serve --keys`; past the first 64 names: other) and HTTP status.",
            ["tenant", "status"],
            registry=r,
        )
        self.cancelled = Counter(
            "openalice_requests_cancelled",
            "Chat completions stopped before their end, by reason (client_gone, deadline).",
            ["reason"],
            registry=r,
        )
        self._runner_tracked = False
        self._scrape_cond = threading.Condition()
        self._rendering = False
        self._generation = 0  # renders finished
        self._scraped: tuple[float, bytes] | None = None  # (monotonic time, text) of the last render
        if otel_reader is not None:
            r.register(OtelBridge(otel_reader))
        if dropped_spans is not None:
            r.register(_DroppedSpans(dropped_spans))

    def track_runner(self, runner: ServedRunner) -> None:
        """Export the runner's admission gates and engine memory (once per registry)."""
        if not self._runner_tracked:
            self.registry.register(_RunnerState(runner))
            self._runner_tracked = True

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def scrape(self, max_age_s: float = 0.0) -> bytes:
        """The rendered text. Blocking: the server calls it in a worker thread. One render at a time:
        a scrape that arrives while one runs waits for it and shares its text, so many scrapers
        at once cost what one does. `max_age_s` > 0 also reuses a render that recent."""
        with self._scrape_cond:
            if self._scraped is not None and time.monotonic() - self._scraped[0] < max_age_s:
                return self._scraped[1]
            if self._rendering:
                generation = self._generation
                while self._rendering and self._generation == generation:
                    self._scrape_cond.wait()
                if self._generation != generation and self._scraped is not None:
                    return self._scraped[1]
            self._rendering = True
        text: bytes | None = None
        try:
            text = self.render()
            return text
        finally:
            with self._scrape_cond:
                self._rendering = False
                if text is not None:
                    self._scraped = (time.monotonic(), text)
                    self._generation += 1
                self._scrape_cond.notify_all()

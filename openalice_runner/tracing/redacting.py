"""A tracer provider that rewrites span attributes as spans start, before any exporter sees them.

FastAPI's built-in telemetry opens the HTTP server span with the raw `url.path` and `url.query`
(only a few cloud signing parameters masked): `?api_key=KEY` or `/v1/models/KEY`, answered 401,
put a key into the trace file. The server hands FastAPI this wrapper, whose tracers pass every
span's start attributes through `rewrite` (the server's: the route template for the path, no query).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer, TracerProvider

Rewrite = Callable[[dict[str, Any]], dict[str, Any]]


class RedactingTracerProvider(TracerProvider):
    """`inner`: the provider spans go to (None: the global one, looked up at each get_tracer)."""

    def __init__(self, inner: TracerProvider | None, rewrite: Rewrite) -> None:
        self.inner = inner
        self.rewrite = rewrite

    def get_tracer(self, *args: Any, **kwargs: Any) -> Tracer:
        inner = self.inner or trace.get_tracer_provider()
        return _RedactingTracer(inner.get_tracer(*args, **kwargs), self.rewrite)


class _RedactingTracer(Tracer):
    def __init__(self, inner: Tracer, rewrite: Rewrite) -> None:
        self.inner = inner
        self.rewrite = rewrite

    def _attrs(self, attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return None if attributes is None else self.rewrite(dict(attributes))

    def start_span(
        self, name: str, context: Any = None, kind: Any = SpanKind.INTERNAL, attributes: Any = None, *args: Any,
        **kwargs: Any,
    ) -> Span:
        return self.inner.start_span(name, context, kind, self._attrs(attributes), *args, **kwargs)

    @contextmanager  # a context manager as the API's, typed by its own decorator: mypy sees another type
    def start_as_current_span(  # type: ignore[override]
        self, name: str, context: Any = None, kind: Any = SpanKind.INTERNAL, attributes: Any = None, *args: Any,
        **kwargs: Any,
    ) -> Iterator[Span]:
        with self.inner.start_as_current_span(name, context, kind, self._attrs(attributes), *args, **kwargs) as span:
            yield span

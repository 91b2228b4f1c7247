"""JSON-lines trace file: one JSON object per finished span.

Fields: trace_id, span_id, parent_id (hex; parent_id null for a root), name, kind, start_ns, end_ns,
attributes, status {code, description}, events [{name, time_ns, attributes}], service.
`openalice-runner trace report` reads it back.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from openalice_runner.private_file import open_private_append


def _attrs(attributes: Any) -> dict[str, Any]:
    # Tuples (OTel sequence attributes) become JSON arrays.
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None  # an SDK span always has its context (typed Optional by the API)
    parent = span.parent
    return {
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": _attrs(span.attributes),
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": _attrs(e.attributes)} for e in span.events
        ],
        "service": span.resource.attributes.get("service.name") if span.resource else None,
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends spans to a file, one JSON object per line; flushed after each batch.

    Called from the batch processor's worker thread, so the caller's request never waits on disk.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        # Spans can carry prompts (--record-content): owner-only, no symlink, not another user's file.
        fd = open_private_append(self.path, "trace file")
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s), default=str, separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            try:
                self._file.write(lines)
                self._file.flush()
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


def read_spans(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Spans of a trace file; a torn last line (writer killed mid-write) is skipped, others must parse."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                return
            raise ValueError(f"{path}:{number}: not a JSON span line: {exc}") from None

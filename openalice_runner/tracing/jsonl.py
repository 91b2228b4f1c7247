"""JSON-lines trace file: one JSON object per finished span.

Fields: trace_id, span_id, parent_id (hex; parent_id null for a root), name, kind, start_ns, end_ns,
attributes, status {code, description}, events [{name, time_ns, attributes}], service.
`openalice-runner trace report` reads it back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from openalice_runner.private_file import open_private_append

logger = logging.getLogger(__name__)

# The trace file's cap (bytes): past it the file moves to PATH.1 and a new one starts, so spans take
# at most twice this on disk (a probe's run once wrote 581 MB to an uncapped file).
DEFAULT_MAX_BYTES = 128 * 1024 * 1024
MIN_MAX_BYTES = 4096


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
    Capped: a line that would take the file past `max_bytes` first moves it to `PATH.1` (replacing
    the one there: one rotated file is kept, so the two hold at most twice the cap) and starts a
    new, owner-only file. A span whose line alone is larger than the cap is left out and counted
    (`oversized`); only --record-content with a huge prompt makes one.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"trace file max_bytes must be at least {MIN_MAX_BYTES}, got {max_bytes}")
        self.path = Path(path)
        self.rotated_path = self.path.with_name(self.path.name + ".1")
        self.max_bytes = max_bytes
        self.oversized = 0
        self._lock = threading.Lock()
        self._file: Any = None
        self._shut = False
        self._open()

    def _open(self) -> None:
        # Spans can carry prompts (--record-content): owner-only, no symlink, not another user's file.
        fd = open_private_append(self.path, "trace file")
        self._size = os.fstat(fd).st_size
        self._file = os.fdopen(fd, "ab")

    def _rotate(self) -> None:
        self._file.close()
        os.replace(self.path, self.rotated_path)  # keeps its owner-only mode: same inode
        self._open()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_dict(s), default=str, separators=(",", ":")).encode() + b"\n" for s in spans]
        with self._lock:
            if self._shut:
                return SpanExportResult.FAILURE
            try:
                if self._file.closed:  # a rotation that could not reopen it: tried again
                    self._open()
                for line in lines:
                    if len(line) > self.max_bytes:
                        self._skip(len(line))
                        continue
                    if self._size + len(line) > self.max_bytes and self._size > 0:
                        self._file.flush()
                        self._rotate()
                    self._file.write(line)
                    self._size += len(line)
                self._file.flush()
            except (OSError, ValueError) as exc:  # ValueError: a rotation could not reopen the file
                logger.warning("trace file %s: %s", self.path, exc)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _skip(self, size: int) -> None:
        self.oversized += 1
        if self.oversized == 1:
            logger.warning("trace file %s: a span of %d bytes is larger than the file's cap (%d); left out",
                           self.path, size, self.max_bytes)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._shut = True
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

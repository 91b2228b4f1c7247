"""Unexpected errors in the log at a bounded rate: one line per error with its request id, the
traceback only the first time each distinct error (type and where it was raised) is seen.

A probe's deep schemas raised a RecursionError per request, each writing 307 KB of traceback:
4 clients grew the log by 46 MB in 10 s. Here a client can add at most `lines_per_s` short lines
a second (a line then says how many were left out), and a traceback per distinct error, ever,
up to `max_tracebacks`.
"""

from __future__ import annotations

import contextvars
import threading
import time
import traceback
from typing import Any

import structlog

from openalice_runner.redaction import redact

log = structlog.get_logger("openalice_runner.server")

# Set by GuardMiddleware for each request (and sent back as X-Request-Id), read where errors are logged.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def _where(exc: BaseException) -> tuple[str, str, int]:
    tb = exc.__traceback__
    frame = traceback.extract_tb(tb)[-1] if tb is not None else None
    return (type(exc).__name__, frame.filename if frame else "?", frame.lineno or 0 if frame else 0)


class ErrorLog:
    def __init__(self, *, lines_per_s: float = 5.0, burst: int = 20, max_tracebacks: int = 64) -> None:
        self.lines_per_s = lines_per_s
        self.burst = burst
        self.max_tracebacks = max_tracebacks
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._seen: set[tuple[str, str, int]] = set()
        self._suppressed = 0
        self._lock = threading.Lock()

    def report(self, event: str, exc: BaseException, **fields: Any) -> bool:
        """Log `exc` (with the current request's id) if the rate allows; True when a line was written."""
        key = _where(exc)
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.lines_per_s)
            self._last = now
            if self._tokens < 1:
                self._suppressed += 1
                return False
            self._tokens -= 1
            suppressed, self._suppressed = self._suppressed, 0
            first = key not in self._seen and len(self._seen) < self.max_tracebacks
            if first:
                self._seen.add(key)
        extra: dict[str, Any] = {"suppressed": suppressed} if suppressed else {}
        if first:
            extra["exc_info"] = exc
        else:
            extra["where"] = f"{key[1]}:{key[2]}"  # the traceback was logged with this error's first line
        log.error(event, request_id=REQUEST_ID.get(), error_type=key[0], error=redact(str(exc))[:200], **fields,
                  **extra)  # fmt: skip
        return True


ERRORS = ErrorLog()

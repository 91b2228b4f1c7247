"""Secrets out of what leaves the process: error bodies, logs, span status messages.

Keys are registered by whoever reads them (the sidecar its API key, providers their upstream keys), and
every message that may carry upstream text goes through `redact()`. Upstream errors often echo the key
they were given ("Incorrect API key provided: sk-...") and tracebacks can show request headers, so
bearer tokens and `sk-` style keys are masked by pattern too, registered or not.
"""

from __future__ import annotations

import re
import threading

_MIN_SECRET_LEN = 6  # shorter values would mask ordinary words
_secrets: set[str] = set()
_lock = threading.Lock()
_PATTERNS = (
    re.compile(r"(?i)(bearer\s+)[^\s\"',;]+"),
    re.compile(r"\b(sk-)[A-Za-z0-9_\-*]{6,}"),
)
MASK = "[REDACTED]"


def register_secret(value: str | None) -> None:
    if value and len(value) >= _MIN_SECRET_LEN:
        with _lock:
            _secrets.add(value)


def redact(text: str) -> str:
    if not text:
        return text
    for secret in _secrets_longest_first():
        if secret in text:
            text = text.replace(secret, MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + MASK, text)
    return text


def _secrets_longest_first() -> list[str]:
    with _lock:
        return sorted(_secrets, key=len, reverse=True)

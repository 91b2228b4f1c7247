"""Metric label values that clients choose, kept to a bounded set.

Every distinct label value is a time series held in memory for the life of the process and
rendered on every scrape, so a value a client picks (a turn type header, a model name, a tool
name) must not become a label as is: 1,500 requests with made-up turn types once grew /metrics
from 52 KB to 21.5 MB. Turn types outside the known set are recorded as `other`; so are model,
tool and tenant names past the first MAX_DISTINCT seen, and any value longer than MAX_VALUE_CHARS. Spans keep the values as sent (they are not held).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from openalice_runner.tracing import attributes as A

OTHER = "other"
# The turn types the project names (policies/default.yaml, the README); a policy or a route adds its own.
STANDARD_TURN_TYPES = frozenset({"chat", "tool_call", "code_edit", "summarize", "rag", "reasoning", OTHER})
MAX_DISTINCT = 64  # per label key, for names with no configured set (models, tools)
# A value longer than this is "other" too: the cap above counts names, not their size, and a label
# value is rendered on every line of its series at every scrape (a 7 MB model name: 535 MB a scrape).
MAX_VALUE_CHARS = 128

# Label keys a client's request decides, besides the turn type; and the tenant, which the operator's
# keys file names, but a file of thousands of keys must not make thousands of series either.
_CAPPED_KEYS = frozenset({A.GEN_AI_REQUEST_MODEL, A.GEN_AI_TOOL_NAME, A.TENANT})


class LabelBounds:
    """`turn_types`: the configured turn types beyond the standard ones (read at each call: a
    reloaded policy counts at once); None: no configured set, so the first MAX_DISTINCT names seen
    are kept, as for models and tools (a library caller picks its own turn types)."""

    def __init__(
        self, turn_types: Callable[[], Iterable[str]] | None = None, max_distinct: int = MAX_DISTINCT
    ) -> None:
        self.turn_types = turn_types
        self.max_distinct = max_distinct
        self._seen: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def turn_type(self, value: Any) -> str:
        value = str(value)
        if value in STANDARD_TURN_TYPES:
            return value
        if len(value) > MAX_VALUE_CHARS:
            return OTHER
        if self.turn_types is None:
            return self._capped(A.TURN_TYPE, value)
        return value if value in self.turn_types() else OTHER

    def tenant(self, value: Any) -> str:
        """A tenant's name as a label: the first MAX_DISTINCT names seen, then "other"."""
        return self._capped(A.TENANT, str(value))

    def bound(self, labels: dict[str, Any]) -> dict[str, Any]:
        """`labels` with client-chosen values bounded (a copy when anything changed)."""
        out = labels
        for key, value in labels.items():
            if key == A.TURN_TYPE:
                bounded = self.turn_type(value)
            elif key in _CAPPED_KEYS:
                bounded = self._capped(key, str(value))
            else:
                continue
            if bounded != value:
                out = dict(out) if out is labels else out
                out[key] = bounded
        return out

    def _capped(self, key: str, value: str) -> str:
        if len(value) > MAX_VALUE_CHARS:
            return OTHER
        with self._lock:
            seen = self._seen.setdefault(key, set())
            if value in seen:
                return value
            if len(seen) >= self.max_distinct:
                return OTHER
            seen.add(value)
            return value

"""What a request's JSON Schema (tools[].function.parameters, response_format.json_schema.schema)
may cost, checked before anything recursive reads it.

jsonschema's meta-schema check, our schema rewrites and the grammar compiler all recurse over a
schema: a few KB nested 100 deep was a RecursionError (500) and 300 KB of traceback per request.
The walk here is iterative. OpenAI itself allows 10 levels of nesting and 5,000 properties in a
structured-output schema; these limits are well above that.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaLimits:
    max_depth: int = 64  # nested JSON objects and arrays
    max_nodes: int = 50_000  # JSON values in all


LIMITS = SchemaLimits()


@dataclass
class CompileLimits:
    """How long a request's grammar may take to compile before it is refused (400); `serve
    --grammar-timeout` sets it for the process (engine/grammar.py reads it at each compile)."""

    timeout_s: float = 10.0


COMPILE = CompileLimits()


def check_schema_limits(schema: Any, limits: SchemaLimits = LIMITS) -> None:
    """ValueError naming the limit `schema` passes (depth or size); nothing recursive runs here."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > limits.max_nodes:
            raise ValueError(f"the schema has more than {limits.max_nodes} JSON values (the limit)")
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limits.max_depth:
            raise ValueError(f"the schema is nested more than {limits.max_depth} levels deep (the limit)")
        stack.extend((child, depth + 1) for child in children)


# ---- schemas already checked: the meta-schema check's result, by the schema's canonical JSON

_VALID: OrderedDict[bytes, None] = OrderedDict()
_VALID_MAX = 4096
_VALID_LOCK = threading.Lock()  # requests are parsed in worker threads


def known_valid(schema: Any) -> bytes | None:
    """None where `schema` (its canonical JSON, by SHA-256) passed the meta-schema check before;
    else the digest to hand to `remember_valid` once it passes. A schema that is not plain JSON
    gets a digest no check remembers, so it is checked every time."""
    try:
        canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return b""
    digest = hashlib.sha256(canonical.encode()).digest()
    with _VALID_LOCK:
        if digest in _VALID:
            _VALID.move_to_end(digest)
            return None
    return digest


def remember_valid(digest: bytes) -> None:
    if not digest:
        return
    with _VALID_LOCK:
        _VALID[digest] = None
        if len(_VALID) > _VALID_MAX:
            _VALID.popitem(last=False)

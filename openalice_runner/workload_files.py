"""Reading workload and prompt files (JSON lines): torch-free, shared by bench, training and loadtest."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def stdlib_context(spec: dict[str, Any]) -> str:
    """Lines FIRST..LAST (1-based, inclusive) of a standard-library module's source."""
    module = importlib.import_module(spec["stdlib"])
    first, last = spec["lines"]
    source = inspect.getsourcefile(module)
    if source is None:  # an extension module (math, array, ...) has no source to quote
        raise ValueError(f"stdlib module {spec['stdlib']!r} has no source file")
    lines = Path(source).read_text().splitlines(keepends=True)
    return "".join(lines[first - 1 : last])


def json_lines(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, object) of a JSON-lines file, skipping blank lines; bad JSON names FILE:LINE."""
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON: {exc}") from exc

"""Reading workload and prompt files (JSON lines): torch-free, shared by bench, training and loadtest."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar


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


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


Item = TypeVar("Item", bound=_HasId)


def pick_by_id(items: list[Item], ids: Sequence[str] | None, what: str) -> list[Item]:
    """The items named by `ids` (all of them without), in the file's order; an unknown id is a
    ValueError naming it."""
    if not ids:
        return items
    known = {item.id for item in items}
    missing = [i for i in ids if i not in known]
    if missing:
        raise ValueError(f"unknown {what} ids: {', '.join(missing)}")
    return [item for item in items if item.id in ids]

"""Agent-turn workloads (format: shared/workloads/README.md) turned into prompts."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COPY_HEAVY = ("code_edit", "rag", "summarize", "tool_call")
OPEN_ENDED = ("chat", "reasoning")


@dataclass
class Case:
    id: str
    turn_type: str
    messages: list[dict[str, Any]]
    max_tokens: int
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def stdlib_context(spec: dict[str, Any]) -> str:
    """Lines FIRST..LAST (1-based, inclusive) of a standard-library module's source."""
    module = importlib.import_module(spec["stdlib"])
    first, last = spec["lines"]
    lines = Path(inspect.getsourcefile(module)).read_text().splitlines(keepends=True)
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


def load_workload(path: str | Path, case_ids: list[str] | None = None) -> list[Case]:
    cases = []
    for _, raw in json_lines(path):
        context = stdlib_context(raw["context"]) if raw.get("context") else ""
        messages = [
            {**m, "content": m["content"].replace("{context}", context)} if isinstance(m.get("content"), str) else m
            for m in raw["messages"]
        ]
        cases.append(Case(raw["id"], raw["turn_type"], messages, int(raw["max_tokens"]), raw.get("tools")))
    if case_ids:
        known = {c.id for c in cases}
        missing = [c for c in case_ids if c not in known]
        if missing:
            raise ValueError(f"unknown case ids: {', '.join(missing)}")
        cases = [c for c in cases if c.id in case_ids]
    return cases


def render_case(engine, case: Case) -> list[int]:
    """Prompt ids as the local provider renders them (tools in the fallback form if needed)."""
    has_tool_history = any(m.get("role") == "tool" or m.get("tool_calls") for m in case.messages)
    if not case.tools and not has_tool_history:
        return engine.render_chat(case.messages)
    from openalice_runner.providers import tool_format

    template = getattr(engine.tokenizer, "chat_template", None)
    if tool_format.template_renders_tools(template if isinstance(template, str) else None):
        return engine.render_chat(tool_format.template_messages(case.messages), case.tools)
    return engine.render_chat(tool_format.render_fallback_messages(case.messages, case.tools))

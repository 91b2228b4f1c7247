"""Agent-turn workloads (format: shared/workloads/README.md) turned into prompts.

The file readers live in `workload_files.py` (torch-free; training and loadtest read the same files).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openalice_runner.workload_files import json_lines, pick_by_id, stdlib_context

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


def load_workload(path: str | Path, case_ids: list[str] | None = None) -> list[Case]:
    cases = []
    for _, raw in json_lines(path):
        context = stdlib_context(raw["context"]) if raw.get("context") else ""
        messages = [
            {**m, "content": m["content"].replace("{context}", context)} if isinstance(m.get("content"), str) else m
            for m in raw["messages"]
        ]
        cases.append(Case(raw["id"], raw["turn_type"], messages, int(raw["max_tokens"]), raw.get("tools")))
    return pick_by_id(cases, case_ids, "case")


def render_case(engine, case: Case) -> list[int]:
    """Prompt ids as the local provider renders them (tools in the fallback form if needed)."""
    from openalice_runner.providers.embedded import tool_format

    return tool_format.render_ids(engine, case.messages, case.tools)

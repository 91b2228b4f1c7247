"""`bench-loops`' workload: the conversations of an `agent-loops.jsonl` file (format:
shared/workloads/README.md), read and checked, a malformed one named by FILE:LINE and the field.

Each conversation has a kind, `chat` or `copy_heavy` (replies that copy from the history), which
the summary's ratios are split by: the workload's `kind` field where a conversation has one; without
it `loop-chat-plan` is chat and every other conversation copy-heavy (DEFAULT_CHAT, the rule before
workloads carried the field)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openalice_runner.workload_files import json_lines, pick_by_id, stdlib_context

KINDS = ("chat", "copy_heavy")
DEFAULT_CHAT = ("loop-chat-plan",)  # without a `kind` field: chat; every other conversation copy-heavy


@dataclass
class Call:
    turn_type: str
    max_tokens: int
    tool_choice: Any = None  # None: not sent (the server's default)
    expect_tool_call: dict[str, Any] | None = None


@dataclass
class Step:
    kind: str  # "call" | "tool_result" | "user"
    call: Call | None = None
    text: str = ""


@dataclass
class Conversation:
    id: str
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    steps: list[Step]
    kind: str = "copy_heavy"  # "chat" | "copy_heavy": what the summary's ratios are split by


def load_loops(path: str | Path, ids: list[str] | None = None) -> list[Conversation]:
    """The conversations of an agent-loops workload; a malformed one names FILE:LINE and the field."""
    conversations = []
    for n, raw in json_lines(path):
        where = f"{path}:{n}"
        try:
            conversations.append(_conversation(raw))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc
    return pick_by_id(conversations, ids, "conversation")


def _conversation(raw: dict[str, Any]) -> Conversation:
    if not isinstance(raw.get("id"), str):
        raise ValueError("`id` must be a string")
    if not isinstance(raw.get("messages"), list) or not raw["messages"]:
        raise ValueError("`messages` must be a non-empty list")
    steps = []
    for i, step in enumerate(raw.get("steps") or []):
        if "call" in step:
            c = step["call"]
            if not isinstance(c.get("turn_type"), str) or not isinstance(c.get("max_tokens"), int):
                raise ValueError(f"steps[{i}].call needs `turn_type` (string) and `max_tokens` (integer)")
            steps.append(Step("call", Call(c["turn_type"], c["max_tokens"], c.get("tool_choice"),
                                           c.get("expect_tool_call"))))
        elif "tool_result" in step:
            context = stdlib_context(step["context"]) if step.get("context") else ""
            steps.append(Step("tool_result", text=str(step["tool_result"]).replace("{context}", context)))
        elif "user" in step:
            steps.append(Step("user", text=str(step["user"])))
        else:
            raise ValueError(f"steps[{i}] must hold `call`, `tool_result` or `user`")
    if not any(s.kind == "call" for s in steps):
        raise ValueError("`steps` holds no call")
    kind = raw.get("kind", "chat" if raw["id"] in DEFAULT_CHAT else "copy_heavy")
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(KINDS)}, got {kind!r}")
    return Conversation(raw["id"], list(raw.get("tools") or []), list(raw["messages"]), steps, kind)

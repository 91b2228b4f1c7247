"""The turn type and conversation of a request whose caller does not state them.

Agent runtimes (Claude Code, Codex, opencode) send no X-OpenAlice-* headers, so without this every
call would be turn type `chat` in no conversation: the policy's main input blind, replica affinity
and prefix reuse without a key. What they do send says a good deal; the table (first row that
holds wins; docs/agent-runtimes.md "Turn types") reads it from the chat request every wire becomes:

| the request                                                   | turn type   |
|---------------------------------------------------------------|-------------|
| forces a tool (tool_choice `required`, a named function, allowed_tools `required`) | tool_call |
| asks for structured output (response_format json_schema / json_object)             | tool_call |
| ends with tool results: of a code-editing tool (read/write/edit/patch a file)      | code_edit |
| ... of a search or retrieval tool (search, retrieve, fetch, grep, docs)             | rag       |
| ... of any other tool                                                              | summarize |
| ends with a user message asking for a summary (summar-, tl;dr)                     | summarize |
| ends with a user message after tool results: as the latest tool result above        | (as above)|
| anything else                                                                      | chat      |

The vocabulary is the policies' (policies/default.yaml): structured output is JSON under a grammar,
copied and forced as a tool call's arguments are, so it is `tool_call`. The conversation: the
session key the wire reads (server/wires/: opencode's `x-session-id` header, Claude Code's session
id, Codex's session-id header), else OpenAI's `prompt_cache_key` (a key the caller keeps per
conversation for cache locality), else its `user`. Headers and `metadata` always win
(server/context.py): those values are `stated`, these `inferred`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from openalice_runner.types import AllowedToolChoice, ChatMessage, ChatRequest, NamedToolChoice

STATED = "stated"
INFERRED = "inferred"

# Tool names are split into words (snake_case, camelCase, kebab-case) and matched word by word.
_CODE_WORDS = frozenset({"edit", "multiedit", "notebookedit", "patch", "write", "read", "file", "files",
                         "replace", "str_replace", "create"})  # fmt: skip
_NOT_CODE_WORDS = frozenset({"todo", "plan"})  # TodoWrite, update_plan: bookkeeping, not files
_RAG_WORDS = frozenset({"search", "retrieve", "retrieval", "fetch", "grep", "glob", "docs", "lookup",
                        "knowledge", "webfetch", "websearch"})  # fmt: skip
_SUMMARY = re.compile(r"\bsummar(?:y|ies|ise|ize|ised|ized|ising|izing)\b|\btl;?dr\b", re.IGNORECASE)
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


@dataclass(frozen=True)
class InferredTurn:
    turn_type: str
    row: str  # which row of the table decided (spans and tests name it)


def infer_turn_type(request: ChatRequest) -> InferredTurn:
    """The turn type the request's shape says (the table above)."""
    choice = request.tool_choice if request.tools else None
    if choice == "required" or isinstance(choice, NamedToolChoice) or (
        isinstance(choice, AllowedToolChoice) and choice.allowed_tools.mode == "required"
    ):
        return InferredTurn("tool_call", "forced_tool")
    fmt = request.response_format
    if fmt is not None and fmt.type in ("json_schema", "json_object"):
        return InferredTurn("tool_call", "structured_output")
    messages = request.messages
    last = messages[-1]
    if last.role == "tool":
        return InferredTurn(_after_tools(messages), "tool_result")
    if last.role == "user" and _SUMMARY.search(last.text or ""):
        return InferredTurn("summarize", "summary_asked")
    if last.role == "user" and any(m.role == "tool" for m in messages):
        return InferredTurn(_after_tools(messages), "follow_up_on_tools")
    return InferredTurn("chat", "default")


def inferred_conversation(request: ChatRequest) -> str | None:
    """The conversation key a Chat Completions caller sends as OpenAI fields."""
    return request.prompt_cache_key or request.user


def tool_kind(name: str) -> str:
    """The turn type a tool's result leads to: code_edit, rag or summarize."""
    words = {w.lower() for w in _WORD.findall(name)} | {name.lower()}
    if words & _CODE_WORDS and not words & _NOT_CODE_WORDS:
        return "code_edit"
    if words & _RAG_WORDS:
        return "rag"
    return "summarize"


def _after_tools(messages: list[ChatMessage]) -> str:
    """The kind of the latest tool results: code_edit over rag over summarize where several answer."""
    names = _call_names(messages)
    latest: list[str] = []
    for message in reversed(messages):
        if message.role == "tool":
            latest.append(names.get(message.tool_call_id or "", ""))
        elif latest:
            break
    kinds = {tool_kind(name) for name in latest if name} or {"summarize"}
    return next(k for k in ("code_edit", "rag", "summarize") if k in kinds)


def _call_names(messages: list[ChatMessage]) -> dict[str, str]:
    return {call.id: call.function.name for m in messages for call in m.tool_calls or ()}

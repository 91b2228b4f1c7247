"""A deterministic stand-in "model" behind the stand-in servers: same request, same answer.

Rules (so tests can predict the output):
- a tool result as the last message -> "The tool said: <its content>";
- tools offered and tool_choice "required", a named function, or "auto" with a tool's name in the last
  user message -> one call of that tool, its first parameter set to the last user message;
- otherwise -> "You said: <last user message>".
Tokens are whitespace-separated words; `max_tokens` cuts the answer (finish_reason "length").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Answer:
    words: list[str]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def completion_tokens(self) -> int:
        if self.tool_calls:
            return sum(len(tc["function"]["arguments"].split()) + 2 for tc in self.tool_calls)
        return len(self.words)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def answer(body: dict[str, Any]) -> Answer:
    messages = body.get("messages") or []
    prompt_tokens = sum(len(_text(m.get("content")).split()) + 4 for m in messages)
    last = messages[-1] if messages else {}
    last_user = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    tools = body.get("tools") or []
    choice = body.get("tool_choice") or ("auto" if tools else "none")

    if last.get("role") == "tool":
        words = f"The tool said: {_text(last.get('content'))}".split()
        return _cut(Answer(words, prompt_tokens=prompt_tokens), body)

    tool = None
    if tools and choice != "none":
        if isinstance(choice, dict):
            tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        elif choice == "required":
            tool = tools[0]
        else:
            tool = next((t for t in tools if t["function"]["name"] in last_user), None)
    if tool is not None:
        params = (tool["function"].get("parameters") or {}).get("properties") or {}
        args = {next(iter(params)): last_user} if params else {}
        call = {
            "id": f"call_{abs(hash(last_user)) % 10**8:08d}",
            "index": 0,
            "type": "function",
            "function": {"name": tool["function"]["name"], "arguments": json.dumps(args)},
        }
        return Answer([], tool_calls=[call], finish_reason="tool_calls", prompt_tokens=prompt_tokens)

    return _cut(Answer(f"You said: {last_user}".split(), prompt_tokens=prompt_tokens), body)


def _cut(ans: Answer, body: dict[str, Any]) -> Answer:
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if limit is not None and len(ans.words) > int(limit):
        ans.words = ans.words[: int(limit)]
        ans.finish_reason = "length"
    return ans


def stream_pieces(ans: Answer) -> list[str]:
    """The text as streamed: one word per chunk, spaces kept so the pieces join back exactly."""
    return [w if i == 0 else " " + w for i, w in enumerate(ans.words)]

"""A Chat Completions conversation written as an Anthropic Messages request, as Claude Code writes
one (`system` blocks, `tool_use` and `tool_result` blocks, tools with `input_schema`), and as an
OpenAI Responses request, as Codex writes one. One translation for the benches that send the same
conversation over several wires (`wire_overhead`, `loops`), so all compare the same request."""

from __future__ import annotations

import json
from typing import Any


def messages_body(messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, model: str | None,
                  max_tokens: int, stream: bool, tool_choice: Any = None) -> dict[str, Any]:
    """The Messages request for Chat `messages`/`tools`/`tool_choice`, greedy (temperature 0).
    Consecutive tool results join one user turn, as Anthropic requires."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "system":
            system.append({"type": "text", "text": m["content"]})
        elif m["role"] == "user":
            turns.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
        elif m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"] or "{}")}
                       for c in m.get("tool_calls") or []]
            turns.append({"role": "assistant", "content": blocks or m.get("content") or ""})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if turns and turns[-1]["role"] == "user" and turns[-1]["content"][-1]["type"] == "tool_result":
                turns[-1]["content"].append(block)
            else:
                turns.append({"role": "user", "content": [block]})
        else:
            raise ValueError(f"a message of role {m['role']!r} has no Messages form")
    body: dict[str, Any] = {"model": model, "system": system, "messages": turns, "max_tokens": max_tokens,
                            "temperature": 0, "stream": stream}
    if tools:
        body["tools"] = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                          "input_schema": t["function"]["parameters"]} for t in tools]
    if tool_choice is not None:
        body["tool_choice"] = anthropic_tool_choice(tool_choice)
    return body


def anthropic_tool_choice(choice: Any) -> dict[str, Any]:
    """Chat's tool_choice in Anthropic's words: required is `any`, a named function is `tool`."""
    if isinstance(choice, str) and choice in ("auto", "none"):
        return {"type": choice}
    if choice == "required":
        return {"type": "any"}
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "tool", "name": choice["function"]["name"]}
    raise ValueError(f"tool_choice {choice!r} has no Messages form")


def responses_body(messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, model: str | None,
                   max_tokens: int, stream: bool) -> dict[str, Any]:
    """The OpenAI Responses request for Chat `messages`/`tools`, as Codex writes it: `instructions`,
    message / function_call / function_call_output items, flat function tools, `store: false`;
    greedy (temperature 0)."""
    instructions, items = [], []
    for m in messages:
        if m["role"] == "system":
            instructions.append(m["content"])
        elif m["role"] == "user":
            items.append(
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": m["content"]}]}
            )
        elif m["role"] == "assistant":
            if m.get("content"):
                items.append(
                    {
                        "type": "message",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": m["content"]}],
                    }
                )
            items += [
                {
                    "type": "function_call",
                    "call_id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": c["function"]["arguments"],
                }
                for c in m.get("tool_calls") or []
            ]
        elif m["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
            )
    body: dict[str, Any] = {
        "model": model,
        "instructions": "\n\n".join(instructions),
        "input": items,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "store": False,
        "stream": stream,
    }
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "name": t["function"]["name"],
                "description": t["function"].get("description", ""),
                "parameters": t["function"]["parameters"],
            }
            for t in tools
        ]
    return body

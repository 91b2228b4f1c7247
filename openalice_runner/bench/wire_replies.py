"""A reply of any wire (Chat Completions, Anthropic Messages, OpenAI Responses), plain or streamed,
read for what the wire benchmark compares: the prompt's token count and the reply's text."""

from __future__ import annotations

import json
from typing import Any


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def _anthropic_input(u: dict[str, Any]) -> int:
    """Anthropic's input_tokens leave out what the cache served: the whole prompt is the sum."""
    return (
        u["input_tokens"]
        + (u.get("cache_read_input_tokens") or 0)
        + (u.get("cache_creation_input_tokens") or 0)
    )


def summary(wire: str, raw: bytes, stream: bool) -> tuple[int, str]:
    """(prompt tokens, reply text) from a reply of any wire, plain or streamed."""
    if stream:
        return _STREAMED[wire](_events(raw))
    return _PLAIN[wire](json.loads(raw))


def _chat(body: dict[str, Any]) -> tuple[int, str]:
    return body["usage"]["prompt_tokens"], body["choices"][0]["message"].get("content") or ""


def _messages(body: dict[str, Any]) -> tuple[int, str]:
    return _anthropic_input(body["usage"]), "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")


def _responses(body: dict[str, Any]) -> tuple[int, str]:
    output = "".join(
        p.get("text", "")
        for item in body["output"]
        if item["type"] == "message"
        for p in item["content"]
        if p["type"] == "output_text"
    )
    return body["usage"]["input_tokens"], output


def _chat_streamed(events: list[dict[str, Any]]) -> tuple[int, str]:
    tokens, text = -1, []
    for e in events:
        for choice in e.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
        if e.get("usage"):
            tokens = e["usage"]["prompt_tokens"]
    return tokens, "".join(text)


def _messages_streamed(events: list[dict[str, Any]]) -> tuple[int, str]:
    tokens, text = -1, []
    for e in events:
        if e["type"] in ("message_start", "message_delta"):  # the counts may come with either
            u = e["message"]["usage"] if e["type"] == "message_start" else e.get("usage") or {}
            if u.get("input_tokens"):
                tokens = _anthropic_input(u)
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
            text.append(e["delta"]["text"])
    return tokens, "".join(text)


def _responses_streamed(events: list[dict[str, Any]]) -> tuple[int, str]:
    tokens, text = -1, []
    for e in events:
        if e["type"] == "response.output_text.delta":
            text.append(e["delta"])
        elif e["type"] in ("response.completed", "response.incomplete"):
            tokens = e["response"]["usage"]["input_tokens"]
    return tokens, "".join(text)


_PLAIN = {"chat": _chat, "messages": _messages, "responses": _responses}
_STREAMED = {"chat": _chat_streamed, "messages": _messages_streamed, "responses": _responses_streamed}

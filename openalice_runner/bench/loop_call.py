"""`bench-loops`' one call: a target, a greedy streamed Chat Completions call to it, timed from
before the request is sent, and the per-call record the report keeps (time to the first chunk that
carries content or a tool call, the whole call, usage, the sidecar's `speculation` extension with
its `first_token` breakdown where it sends one)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from openalice_runner.bench.loop_workload import Call

INFERRED_SUFFIX = "-inferred"  # a built-in target's twin that states no turn types (Target.stated)


class LoopError(RuntimeError):
    """A target answered a call with an error (or not in the streamed OpenAI shape)."""


@dataclass
class Target:
    name: str
    url: str  # the API base, ending in /v1
    model: str | None = None  # None: the first model its GET /models lists
    # False: the calls go over the Messages wire as Claude Code sends them, with no X-OpenAlice-*
    # headers, only its session id: the sidecar infers the turn types (bench/loop_messages.py)
    stated: bool = True


@dataclass
class CallRecord:
    turn_type: str
    ttft_s: float
    seconds: float
    completion_tokens: int | None
    cached_tokens: int | None
    prompt_tokens: int | None
    speculation: dict[str, Any] | None
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    tokens_counted: str = "usage"  # or "chunks": the server sent no usage; one streamed chunk a token

    def as_json(self) -> dict[str, Any]:
        return {
            "turn_type": self.turn_type,
            "ttft_s": round(self.ttft_s, 4),
            "seconds": round(self.seconds, 4),
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "prompt_tokens": self.prompt_tokens,
            "speculation": self.speculation,
            "finish_reason": self.finish_reason,
            "tokens_counted": self.tokens_counted,
            "output": self.output,
        }

    @property
    def output(self) -> str:
        """What the call produced, as compared between targets: content and tool calls."""
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in self.tool_calls]
        return self.content if not calls else json.dumps({"content": self.content, "tool_calls": calls})


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError as exc:
            raise LoopError(f"not JSON in the stream: {data[:200]!r}") from exc
        if "error" in event:
            raise LoopError(f"error in the stream: {json.dumps(event['error'])[:500]}")
        yield event


def stream_call(client, target: Target, messages: list[dict], tools: list[dict], call: Call,
                headers: dict[str, str], conversation_key: str | None = None) -> CallRecord:
    """One greedy streamed Chat Completions call; the clock starts before the request is sent. The
    conversation goes as X-OpenAlice-Conversation-Id."""
    if conversation_key is not None:
        headers = {"X-OpenAlice-Conversation-Id": conversation_key, **headers}
    body: dict[str, Any] = {
        "model": target.model,
        "messages": messages,
        "max_tokens": call.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body["tools"] = tools
    if call.tool_choice is not None:
        body["tool_choice"] = call.tool_choice
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] | None = None
    speculation = finish = None
    ttft = None
    chunks = 0  # chunks that carry text or a call: tokens, for a server that sends no usage
    t0 = time.perf_counter()
    with client.stream("POST", f"{target.url}/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise LoopError(f"{target.name}: HTTP {response.status_code}: {response.text[:500]}")
        for event in sse_events(response.iter_lines()):
            usage = event.get("usage") or usage
            speculation = event.get("speculation") or speculation
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                if delta.get("content"):
                    content.append(delta["content"])
                for d in delta.get("tool_calls") or []:
                    entry = calls.setdefault(d.get("index", 0),
                                             {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    entry["id"] = d.get("id") or entry["id"]
                    fn = d.get("function") or {}
                    entry["function"]["name"] += fn.get("name") or ""
                    entry["function"]["arguments"] += fn.get("arguments") or ""
                if delta.get("content") or delta.get("tool_calls"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return CallRecord(
        turn_type=call.turn_type,
        ttft_s=seconds if ttft is None else ttft,
        seconds=seconds,
        completion_tokens=usage.get("completion_tokens", chunks),
        cached_tokens=details.get("cached_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        speculation=speculation,
        content="".join(content),
        tool_calls=[calls[i] for i in sorted(calls)],
        finish_reason=finish,
        tokens_counted="usage" if "completion_tokens" in usage else "chunks",
    )

"""One loop call over the Anthropic Messages wire, as Claude Code makes it: no X-OpenAlice-*
headers, the conversation named by its session id (the `X-Claude-Code-Session-Id` header and
`metadata.user_id`), streamed. The `-inferred` twins of `bench-loops` call this way, so the sidecar
infers each turn type from the request's shape; the reply is read back into the Chat record the
summary compares (text, tool calls in Chat's form, usage, the runner's `speculation`)."""

from __future__ import annotations

import json
import time
from typing import Any

from openalice_runner.bench.loop_call import CallRecord, LoopError, Target, sse_events
from openalice_runner.bench.loop_workload import Call
from openalice_runner.bench.wire_bodies import messages_body

# Anthropic's stop reasons as Chat's finish reasons, so the twins' records compare field for field
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def messages_call(client, target: Target, messages: list[dict], tools: list[dict], call: Call,
                  conversation_key: str) -> CallRecord:
    """One greedy streamed call to TARGET's `/v1/messages`; the clock starts before it is sent."""
    body = messages_body(messages, tools, model=target.model, max_tokens=call.max_tokens, stream=True,
                         tool_choice=call.tool_choice)
    body["metadata"] = {"user_id": json.dumps({"session_id": conversation_key})}
    headers = {"X-Claude-Code-Session-Id": conversation_key, "anthropic-version": "2023-06-01"}
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}  # by content block index
    usage: dict[str, Any] = {}
    speculation = stop = None
    ttft = None
    chunks = 0
    t0 = time.perf_counter()
    with client.stream("POST", f"{target.url}/messages", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise LoopError(f"{target.name}: HTTP {response.status_code}: {response.text[:500]}")
        for event in sse_events(response.iter_lines()):
            kind = event.get("type")
            if kind == "message_start":
                usage.update(event["message"].get("usage") or {})
            elif kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
                block = event["content_block"]
                calls[event["index"]] = {"id": block["id"], "type": "function",
                                         "function": {"name": block["name"], "arguments": ""}}
            elif kind == "content_block_delta":
                delta = event["delta"]
                if delta["type"] == "text_delta":
                    text.append(delta["text"])
                elif delta["type"] == "input_json_delta":
                    calls[event["index"]]["function"]["arguments"] += delta["partial_json"]
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            elif kind == "message_delta":
                usage.update(event.get("usage") or {})  # cumulative counts
                stop = (event.get("delta") or {}).get("stop_reason") or stop
                speculation = event.get("speculation") or speculation
    seconds = time.perf_counter() - t0
    cached = usage.get("cache_read_input_tokens")
    prompt = usage.get("input_tokens")
    if prompt is not None:
        prompt += (cached or 0) + (usage.get("cache_creation_input_tokens") or 0)  # input_tokens leave the cache out
    return CallRecord(
        turn_type=call.turn_type,
        ttft_s=seconds if ttft is None else ttft,
        seconds=seconds,
        completion_tokens=usage.get("output_tokens", chunks),
        cached_tokens=cached,
        prompt_tokens=prompt,
        speculation=speculation,
        content="".join(text),
        tool_calls=[calls[i] for i in sorted(calls)],
        finish_reason=FINISH.get(stop, stop),
        tokens_counted="usage" if "output_tokens" in usage else "chunks",
    )

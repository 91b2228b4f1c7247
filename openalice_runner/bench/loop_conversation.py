"""`bench-loops`' one conversation, driven as a loop drives it: the whole history resent with every
model call, the model's reply appended, then the tool's result or the user's next message.

Each run of a conversation starts with a line naming the repeat (`Session N.`) in front of its
first message: without it a server that keeps finished histories for prefix reuse (ours,
llama.cpp's prompt cache) would serve the next repeat's first call from the previous one, and
the first call would no longer be the cold one a new conversation makes."""

from __future__ import annotations

import json
import time
from typing import Any

from openalice_runner.bench.loop_call import CallRecord, LoopError, Target, stream_call
from openalice_runner.bench.loop_messages import messages_call
from openalice_runner.bench.loop_workload import Conversation

SESSION_LINE = "Session {n}.\n"


def opening_messages(conversation: Conversation, run: int) -> list[dict[str, Any]]:
    """The conversation's opening messages, the first one led by the run's session line."""
    messages = [dict(m) for m in conversation.messages]
    first = messages[0]
    if isinstance(first.get("content"), str):
        first["content"] = SESSION_LINE.format(n=run + 1) + first["content"]
    return messages


def _runnable(call: dict[str, Any]) -> bool:
    """A streamed call a loop can run: its arguments are a JSON object (a call cut by max_tokens
    streams arguments that stop short; the loop answers the expected call instead)."""
    try:
        return isinstance(json.loads(call["function"]["arguments"] or "{}"), dict)
    except json.JSONDecodeError:
        return False


def run_conversation(client, target: Target, conversation: Conversation, run: int) -> dict[str, Any]:
    """Drive one conversation as a loop does; returns its record (wall time, calls, outputs)."""
    messages = opening_messages(conversation, run)
    key = f"{conversation.id}.{target.name}.{run}"
    records: list[CallRecord] = []
    last_call_id: str | None = None
    t0 = time.perf_counter()
    for i, step in enumerate(conversation.steps):
        if step.kind == "call":
            call = step.call
            if target.stated:
                headers = {"X-OpenAlice-Turn-Type": call.turn_type, "X-OpenAlice-Step": str(len(records))}
                record = stream_call(client, target, messages, conversation.tools, call, headers, key)
            else:
                record = messages_call(client, target, messages, conversation.tools, call, key)
            records.append(record)
            reply: dict[str, Any] = {"role": "assistant", "content": record.content or None}
            tool_calls = [dict(c, id=c["id"] or f"call_{len(records)}_{k}")
                          for k, c in enumerate(record.tool_calls) if _runnable(c)]
            following = conversation.steps[i + 1].kind if i + 1 < len(conversation.steps) else None
            # the workload answers one call, where a tool result follows: a loop sends back only the
            # calls it answers (Anthropic's API refuses a tool_use without its tool_result, OpenAI's a
            # tool call without its tool message)
            tool_calls = tool_calls[-1:] if following == "tool_result" else []
            if not tool_calls and following == "tool_result" and call.expect_tool_call:
                # the loop needs a call to answer: the one the workload expects
                expected = call.expect_tool_call
                tool_calls = [{"id": f"call_{len(records)}_0", "type": "function",
                               "function": {"name": expected["name"], "arguments": json.dumps(expected["arguments"])}}]
            if tool_calls:
                reply["tool_calls"] = tool_calls
                last_call_id = tool_calls[-1]["id"]
            if reply["content"] is None and not tool_calls:
                reply["content"] = ""
            messages.append(reply)
        elif step.kind == "tool_result":
            if last_call_id is None:
                raise LoopError(f"{conversation.id}: steps[{i}] is a tool result but no call was made before it")
            messages.append({"role": "tool", "tool_call_id": last_call_id, "content": step.text})
        else:
            messages.append({"role": "user", "content": step.text})
    return {
        "id": conversation.id,
        "target": target.name,
        "run": run,
        "seconds": round(time.perf_counter() - t0, 4),
        "calls": records,
    }

"""Reading a provider's stream to the end in tests, the way callers must: inside its `async with`."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from openalice_runner.providers.streams import ChatStream
from openalice_runner.types import ChatChunk


async def read_all(opened: AbstractAsyncContextManager[ChatStream]) -> list[ChatChunk]:
    async with opened as chunks:
        return [c async for c in chunks]


def joined_tool_calls(chunks: list[ChatChunk]) -> list[dict[str, str]]:
    """The streamed tool calls as a client joins them (OpenAI's semantics): by index, id, type and
    name from the index's first delta (and only there), the arguments' fragments concatenated."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.tool_call_deltas:
            fn = delta.function
            if delta.index not in calls:
                assert delta.id and delta.type == "function" and fn and fn.name, f"first delta of a call: {delta}"
                calls[delta.index] = {"id": delta.id, "name": fn.name, "arguments": fn.arguments or ""}
            else:
                assert delta.id is None and (fn is None or fn.name is None), f"a later delta of a call: {delta}"
                calls[delta.index]["arguments"] += (fn.arguments or "") if fn else ""
    assert sorted(calls) == list(range(len(calls))), f"call indices {sorted(calls)}"
    return [calls[i] for i in sorted(calls)]

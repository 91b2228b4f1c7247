"""A streamed Anthropic message: ChatChunks as Anthropic's server-sent events.

message_start (and a ping) first; then per content block content_block_start, its deltas (text_delta,
input_json_delta) and content_block_stop, blocks one after another (a text block, then one tool_use
block per call); then message_delta (stop_reason, usage) and message_stop. A fault after the start is
an `error` event, which ends the stream. Each event is `event: NAME` and `data: JSON`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from openalice_runner.server.errors import APIError
from openalice_runner.server.wires.messages_reply import MessageState, error_event, event, stop_reason
from openalice_runner.server.wires.messages_reply import usage as anthropic_usage
from openalice_runner.types import ChatChunk, ToolCallDelta, Usage


class MessagesStream:
    def __init__(self, state: MessageState, *, message_id: str) -> None:
        self.state = state
        self.message_id = message_id
        self.started = False
        self.index = -1  # the open block's index (blocks are numbered in the order they start)
        self.open: str | None = None  # the open block's type
        self.calls: dict[int, int] = {}  # tool call index -> its block's index
        self.call_args: dict[int, list[str]] = {}  # block index -> the call's arguments so far
        self.tool_used = False

    def chunk(self, chunk: ChatChunk) -> Iterable[bytes]:
        yield from self._start(chunk.model)
        text = chunk.delta_text
        if text:
            if self.open != "text":
                yield from self._begin({"type": "text", "text": ""}, "text")
            yield self._delta({"type": "text_delta", "text": text})
        for delta in chunk.tool_call_deltas:
            yield from self._tool_delta(delta)

    def end(self, last: ChatChunk | None, usage: Usage | None) -> Iterable[bytes]:
        yield from self._start(last.model if last is not None else self.state.model)
        yield from self._close()
        finish = last.finish_reason if last is not None else None
        stop = last.stop_sequence if last is not None else None
        reason, sequence = stop_reason(finish, self.tool_used, stop, self.state)
        data: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": anthropic_usage(usage),
        }
        if last is not None and last.speculation is not None:
            data["speculation"] = last.speculation.model_dump()  # the runner's extension, as on Chat
        yield event("message_delta", data)
        yield event("message_stop", {"type": "message_stop"})

    def error(self, error: APIError) -> bytes:
        return error_event(error)

    # ---- pieces

    def _start(self, model: str) -> Iterator[bytes]:
        if self.started:
            return
        self.started = True
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # the prompt's count comes with the last chunk: message_delta carries it (cumulative)
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        yield event("message_start", {"type": "message_start", "message": message})
        yield event("ping", {"type": "ping"})

    def _begin(self, block: dict[str, Any], kind: str) -> Iterator[bytes]:
        yield from self._close()
        self.index += 1
        self.open = kind
        yield event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self) -> Iterator[bytes]:
        if self.open is not None:
            yield event("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = None

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> bytes:
        at = self.index if index is None else index
        return event("content_block_delta", {"type": "content_block_delta", "index": at, "delta": delta})

    def _tool_delta(self, delta: ToolCallDelta) -> Iterator[bytes]:
        function = delta.function
        if delta.index not in self.calls:
            if not delta.id or function is None or not function.name:
                raise APIError(502, "the provider's stream began a tool call without its id and name",
                               code="stream_broken")  # fmt: skip
            block = {"type": "tool_use", "id": delta.id, "name": function.name, "input": {}}
            yield from self._begin(block, "tool_use")
            self.calls[delta.index] = self.index
            self.call_args[self.index] = []
            self.tool_used = True
        at = self.calls[delta.index]
        if function is not None and function.arguments:
            if at != self.index or self.open != "tool_use":
                # Anthropic's blocks do not interleave: a piece of a call whose block is closed
                raise APIError(502, "the provider's stream interleaved two tool calls", code="stream_broken")
            self.call_args[at].append(function.arguments)
            yield self._delta({"type": "input_json_delta", "partial_json": function.arguments}, at)

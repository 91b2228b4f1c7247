"""ChatChunks -> the Responses stream: the events OpenAI sends, in its order, each with `sequence_number`.

    response.created, response.in_progress
    per text item:  response.output_item.added, response.content_part.added,
                    response.output_text.delta ..., response.output_text.done,
                    response.content_part.done, response.output_item.done
    per tool call:  response.output_item.added, response.function_call_arguments.delta ...,
                    response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (the whole Response, usage included)

A fault after the start: an `error` event, then `response.failed` (Codex reads the code of the
latter's `response.error`, e.g. `context_length_exceeded`). Items are sequential: one is done before
the next is added, as OpenAI streams them; a tool call's pieces arrive in order (the providers stream
calls one after another), so a piece for a call already done is a broken stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from openalice_runner.providers.base import StreamBroken
from openalice_runner.server.errors import APIError
from openalice_runner.server.wires.responses.reply import (
    ResponseShell,
    function_call_item,
    message_item,
    new_id,
    output_text,
    status_of,
    usage_of,
)
from openalice_runner.server.wires.responses.translate import ToolName
from openalice_runner.types import ChatChunk, ChatMessage, SpeculationInfo, ToolCall, Usage


def sse_event(event: dict[str, Any]) -> bytes:
    """One event as OpenAI frames it: `event: <type>` and its JSON on one `data:` line."""
    return (
        f"event: {event['type']}\ndata: ".encode()
        + json.dumps(event, separators=(",", ":")).encode()
        + b"\n\n"
    )


@dataclass
class _Item:
    kind: str  # "message" | "function_call"
    id: str
    index: int  # output_index
    call_index: int | None = None  # the chat stream's tool call index
    call_id: str = ""
    name: str = ""
    text: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None  # the finished item


class ResponseEvents:
    """One streamed response: `start()`, `feed(chunk)` per chunk, then `finish()` or `fail(error)`.
    Each returns the events to send, in order; `response` is the final Response object."""

    def __init__(self, shell: ResponseShell, names: dict[str, ToolName]) -> None:
        self.shell, self.names = shell, names
        self.seq = 0
        self.items: list[_Item] = []
        self.current: _Item | None = None
        self.finish_reason: Any = None
        self.usage: Usage | None = None
        self.model: str | None = None
        self.speculation: SpeculationInfo | None = None
        self.provider: str | None = None
        self.fallback_from: list[str] | None = None
        self.response: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.shell.render(status="in_progress", output=[])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def feed(self, chunk: ChatChunk) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self.model = chunk.model or self.model
        text = chunk.delta_text
        if text:
            out += self._text(text)
        for delta in chunk.tool_call_deltas:
            out += self._call_piece(delta)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage
        self.speculation = chunk.speculation or self.speculation
        self.provider = chunk.provider or self.provider
        self.fallback_from = chunk.fallback_from or self.fallback_from
        return out

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.items:  # nothing written and nothing called: one empty message, as the plain reply has
            out += self._open_message()
        out += self._close_current()
        status, incomplete = status_of(self.finish_reason)
        self.response = self.shell.render(
            status=status,
            output=[item.done for item in self.items if item.done is not None],
            usage=usage_of(self.usage),
            incomplete_details=incomplete,
            model=self.model,
            speculation=self.speculation,
            provider=self.provider,
            fallback_from=self.fallback_from,
        )
        out.append(self._event(f"response.{status}", response=self.response))
        return out

    def fail(self, error: APIError) -> list[dict[str, Any]]:
        """The stream broke after it started: an `error` event, then `response.failed`."""
        failed = self.shell.render(
            status="failed",
            output=[item.done for item in self.items if item.done is not None],
            error={"code": error.code or error.type, "message": error.message},
            model=self.model,
        )
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=failed),
        ]

    def as_message(self) -> ChatMessage:
        """The assistant message this response adds to the conversation, as the chat request saw it
        (namespaced functions by the flattened name the model used)."""
        text = "".join("".join(i.text) for i in self.items if i.kind == "message")
        calls = [
            ToolCall(id=i.call_id, function={"name": i.name, "arguments": "".join(i.text)})
            for i in self.items
            if i.kind == "function_call"
        ]
        return ChatMessage(
            role="assistant", content=text if text or not calls else None, tool_calls=calls or None
        )

    # ------------------------------------------------------------ items

    def _text(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.current is None or self.current.kind != "message":
            out += self._close_current()
            out += self._open_message()
        item = self.current
        assert item is not None
        item.text.append(text)
        out.append(self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                               content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        item = _Item("message", new_id("msg"), len(self.items))
        self.items.append(item)
        self.current = item
        return [
            self._event("response.output_item.added", output_index=item.index,
                        item=message_item(item.id, "", "in_progress")),
            self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                        content_index=0, part=output_text("")),
        ]  # fmt: skip

    def _call_piece(self, delta: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        item = self.current
        if item is None or item.kind != "function_call" or item.call_index != delta.index:
            if any(i.call_index == delta.index for i in self.items):
                raise StreamBroken(f"tool call {delta.index} continued after another began", provider=None)
            out += self._close_current()
            name = delta.function.name if delta.function and delta.function.name else ""
            if not delta.id or not name:
                raise StreamBroken(f"tool call {delta.index} began without its id and name", provider=None)
            item = _Item("function_call", new_id("fc"), len(self.items), delta.index, delta.id, name)
            self.items.append(item)
            self.current = item
            added = function_call_item(item.id, item.call_id, name, "", "in_progress", self.names)
            out.append(self._event("response.output_item.added", output_index=item.index, item=added))
        piece = delta.function.arguments if delta.function and delta.function.arguments else ""
        if piece:
            item.text.append(piece)
            out.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                   output_index=item.index, delta=piece))  # fmt: skip
        return out

    def _close_current(self) -> list[dict[str, Any]]:
        item = self.current
        if item is None:
            return []
        self.current = None
        text = "".join(item.text)
        if item.kind == "message":
            status, _ = status_of(self.finish_reason)
            item.done = message_item(item.id, text, status)
            return [
                self._event("response.output_text.done", item_id=item.id, output_index=item.index,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=item.id, output_index=item.index,
                            content_index=0, part=output_text(text)),
                self._event("response.output_item.done", output_index=item.index, item=item.done),
            ]  # fmt: skip
        item.done = function_call_item(item.id, item.call_id, item.name, text, "completed", self.names)
        return [
            self._event("response.function_call_arguments.done", item_id=item.id, output_index=item.index,
                        arguments=text),
            self._event("response.output_item.done", output_index=item.index, item=item.done),
        ]  # fmt: skip

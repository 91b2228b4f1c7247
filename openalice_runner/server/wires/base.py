"""What a wire is to the request path (server/pipeline.py): the interface every wire implements.

The package docstring (server/wires/__init__.py) says how the pieces fit; this module only types them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response

from openalice_runner.server.errors import APIError
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.validation import ServerChatRequest
from openalice_runner.types import ChatChunk, ChatResult, Usage

_MAX_ID = 256  # as server/context.py: a conversation id is a metric-free label, bounded


@dataclass
class WireCall:
    """One request as the pipeline runs it: the chat request the wire made of its body, what the wire's
    own keys say of the turn, and whatever the wire keeps to format the answer (`state`, its own)."""

    body: ServerChatRequest
    # The conversation as the wire's own session keys name it (Claude Code's X-Claude-Code-Session-Id,
    # ...), used where no X-OpenAlice-Conversation-Id header or metadata.conversation_id states one.
    conversation_id: str | None = None
    conversation_source: str | None = None  # which key it came from, e.g. "x-claude-code-session-id"
    state: Any = None
    headers: dict[str, str] = field(default_factory=dict)  # added to the reply (plain and streamed)


def session_key(value: Any) -> str | None:
    """A wire's session key as a conversation id, or None where it is none to use (absent, empty, not
    printable, longer than 256): a key that is not ours to check is left out, never a 400."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > _MAX_ID or not value.isprintable():
        return None
    return value


class StreamFormat(Protocol):
    """One stream's events, in its wire's SSE shape. server/streaming.py's SSEStream calls it and keeps
    the bookkeeping (metrics, the turn, closing the provider's stream) itself, exactly once."""

    def chunk(self, chunk: ChatChunk) -> Iterable[bytes]:
        """The events one provider chunk becomes (none is fine)."""
        ...

    def end(self, last: ChatChunk | None, usage: Usage | None) -> Iterable[bytes]:
        """The events that end a stream that ran to its end. `last`: its last chunk (finish reason,
        speculation); `usage`: the last usage any chunk carried."""
        ...

    def error(self, error: APIError) -> bytes:
        """The event that ends a stream that failed after it started (the status line is gone)."""
        ...


class Wire(Protocol):
    """A wire shape: how its body becomes the chat request, and how answers and errors look on it."""

    name: str  # "chat", "messages", "responses"

    async def read(self, request: Request, settings: ServerSettings) -> WireCall:
        """The request's body, parsed, validated and translated (off the event loop where it is heavy:
        server/body.py's worker-thread hop). Bad input raises APIError (or RequestValidationError),
        which the error handlers answer in this wire's shape."""
        ...

    def reply(self, result: ChatResult, call: WireCall) -> Response:
        """A whole (not streamed) answer."""
        ...

    def stream_format(self, call: WireCall) -> StreamFormat:
        """A fresh formatter for one stream."""
        ...

    def error_body(self, error: APIError) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The error as this wire answers it: status, JSON body, headers (Retry-After kept)."""
        ...

    def stream_error(self, error: APIError) -> bytes:
        """The SSE event that ends a stream of this wire with `error` where no formatter is at hand
        (the guard cutting a stream at shutdown)."""
        ...

"""The Responses wire as the request path (server/pipeline.py) runs it: `POST /v1/responses`.

The conversation is Codex's `session-id` header, else the body's `prompt_cache_key` (both name one
Codex thread; X-OpenAlice-Conversation-Id and metadata.conversation_id still win). Errors are OpenAI's
shape, as on Chat Completions.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from openalice_runner.server.errors import APIError
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.wires.base import WireCall, session_key
from openalice_runner.server.wires.responses.body import parse_responses_request
from openalice_runner.server.wires.responses.events import ResponseEvents, sse_event
from openalice_runner.server.wires.responses.reply import ResponseShell, response_of, shell_of
from openalice_runner.server.wires.responses.store import ResponseStore, credential_of
from openalice_runner.server.wires.responses.translate import Translation, to_chat
from openalice_runner.types import ChatChunk, ChatMessage, ChatResult, Usage

SESSION_HEADER = "session-id"  # Codex's: one id per thread, sent on every call


@dataclass
class ResponsesState:
    """What the reply needs of the request: the Response's fixed parts, the names the caller gave its
    tools, and where to keep the response for `previous_response_id`."""

    shell: ResponseShell
    translation: Translation
    credential: str
    store: bool


class ResponsesWire:
    name = "responses"

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore()
        self._lock = threading.Lock()  # the store is read in the worker thread, written on the loop

    async def read(self, request: Request, settings: ServerSettings) -> WireCall:
        raw = await request.body()
        credential = credential_of(request.headers)
        state = await anyio.to_thread.run_sync(
            self._translate, raw, request.headers.get("content-type"), credential, settings.max_tokens_limit
        )
        conversation, source = _conversation(request.headers, state.shell.echo.get("prompt_cache_key"))
        return WireCall(
            body=state.translation.request,
            conversation_id=conversation,
            conversation_source=source,
            state=state,
        )

    def _translate(self, raw: bytes, content_type: str | None, credential: str, limit: int) -> ResponsesState:
        body = parse_responses_request(raw, content_type)
        previous = None
        if body.previous_response_id is not None:
            with self._lock:
                previous = self.store.get(credential, body.previous_response_id)
        translation = to_chat(body, previous=previous, max_tokens_limit=limit)
        shell = shell_of(body, translation.tools_not_offered)
        return ResponsesState(shell, translation, credential, store=body.store is not False)

    def reply(self, result: ChatResult, call: WireCall) -> Response:
        state: ResponsesState = call.state
        data = response_of(state.shell, result, state.translation.tool_names)
        self._keep(state, result.as_message())
        return JSONResponse(data, headers=call.headers or None)

    def stream_format(self, call: WireCall) -> ResponsesStream:
        state: ResponsesState = call.state
        return ResponsesStream(ResponseEvents(state.shell, state.translation.tool_names), self, state)

    def error_body(self, error: APIError) -> tuple[int, dict[str, Any], dict[str, str]]:
        return error.status_code, as_responses_error(error).body(), dict(error.headers or {})

    def stream_error(self, error: APIError) -> bytes:
        return sse_event({"type": "error", "sequence_number": 0, "code": error.code, "message": error.message,
                          "param": error.param})  # fmt: skip

    def _keep(self, state: ResponsesState, answer: ChatMessage) -> None:
        if state.store:
            with self._lock:
                self.store.put(state.credential, state.shell.id, [*state.translation.conversation, answer])


# Chat request fields a provider's error may name, as the Responses body calls them.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def as_responses_error(error: APIError) -> APIError:
    """`error` naming the Responses field where a provider named the chat request's (the embedded
    engine's context check names `messages`: the caller sent `input`)."""
    head = (error.param or "").split("[", 1)[0].split(".", 1)[0]
    if head not in _PARAMS:
        return error
    renamed = APIError(error.status_code, error.message, param=_PARAMS[head], code=error.code, type=error.type,
                       headers=error.headers)  # fmt: skip
    return renamed


class ResponsesStream:
    """One stream's events (events.py), started lazily so an empty stream still opens and closes a
    Response; a finished response is kept for `previous_response_id` as a plain one is."""

    def __init__(self, events: ResponseEvents, wire: ResponsesWire, state: ResponsesState) -> None:
        self.events, self.wire, self.state = events, wire, state
        self.started = False

    def _start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        return self.events.start()

    def chunk(self, chunk: ChatChunk) -> Iterable[bytes]:
        return [sse_event(e) for e in self._start() + self.events.feed(chunk)]

    def end(self, last: ChatChunk | None, usage: Usage | None) -> Iterable[bytes]:
        if usage is not None:
            self.events.usage = usage
        out = [sse_event(e) for e in self._start() + self.events.finish()]
        self.wire._keep(self.state, self.events.as_message())
        return out

    def error(self, error: APIError) -> bytes:
        return b"".join(sse_event(e) for e in self._start() + self.events.fail(as_responses_error(error)))


def _conversation(headers: Mapping[str, str], prompt_cache_key: Any) -> tuple[str | None, str | None]:
    session = session_key(headers.get(SESSION_HEADER))
    if session is not None:
        return session, SESSION_HEADER
    key = session_key(prompt_cache_key)
    return (key, "prompt_cache_key") if key is not None else (None, None)

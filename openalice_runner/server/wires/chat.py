"""OpenAI Chat Completions (POST /v1/chat/completions): the wire the request path speaks natively.

The body is the chat request itself (ServerChatRequest); the reply and chunks are `to_openai()`;
errors are OpenAI's {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from openalice_runner.server.body import read_chat_request
from openalice_runner.server.errors import APIError
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.streaming import sse
from openalice_runner.server.wires.base import WireCall, session_key
from openalice_runner.types import ChatChunk, ChatResult, Usage

SESSION_HEADER = "x-session-id"


class ChatCompletionsWire:
    name = "chat"

    async def read(self, request: Request, settings: ServerSettings) -> WireCall:
        body = await read_chat_request(request, max_tokens_limit=settings.max_tokens_limit)
        # opencode names its session in x-session-id (the AI SDK's openai-compatible provider sends
        # neither prompt_cache_key nor user): the conversation where none is stated
        session = session_key(request.headers.get(SESSION_HEADER))
        return WireCall(body=body, conversation_id=session, conversation_source=SESSION_HEADER if session else None)

    def reply(self, result: ChatResult, call: WireCall) -> Response:
        return JSONResponse(result.to_openai(), headers=call.headers or None)

    def stream_format(self, call: WireCall) -> ChatChunks:
        options = call.body.stream_options
        return ChatChunks(include_usage=bool(options and options.include_usage))

    def error_body(self, error: APIError) -> tuple[int, dict[str, Any], dict[str, str]]:
        return openai_error_body(error)

    def stream_error(self, error: APIError) -> bytes:
        return sse(error.body())


def openai_error_body(error: APIError) -> tuple[int, dict[str, Any], dict[str, str]]:
    return error.status_code, error.body(), dict(error.headers or {})


class ChatChunks:
    """ChatChunk -> OpenAI's `data: {chunk}` events, the usage chunk (stream_options.include_usage)
    and `data: [DONE]`."""

    def __init__(self, *, include_usage: bool) -> None:
        self.include_usage = include_usage

    def chunk(self, chunk: ChatChunk) -> Iterable[bytes]:
        data = chunk.to_openai()
        data.pop("usage", None)
        if self.include_usage:
            data["usage"] = None  # OpenAI: null on every chunk but the last
        if data["choices"]:
            yield sse(data)

    def end(self, last: ChatChunk | None, usage: Usage | None) -> Iterable[bytes]:
        if self.include_usage and usage is not None and last is not None:
            final = {
                "id": last.id,
                "object": "chat.completion.chunk",
                "created": last.created,
                "model": last.model,
                "choices": [],
                "usage": usage.model_dump(),
            }
            if last.speculation is not None:
                final["speculation"] = last.speculation.model_dump()
            yield sse(final)
        yield b"data: [DONE]\n\n"

    def error(self, error: APIError) -> bytes:
        return sse(error.body())  # OpenAI's error body as a data event, as OpenAI's own streams end

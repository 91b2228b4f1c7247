"""Anthropic Messages (POST /v1/messages, `?beta=true` as Claude Code sends it; POST
/v1/messages/count_tokens): the wire Claude Code and `@ai-sdk/anthropic` speak.

The body is read as Anthropic publishes it (messages_request.py, which says what each field means
here) and translated onto the chat request (messages_translate.py); the reply is a `message` with a
`msg_` id, content blocks (`text`, `tool_use`), `stop_reason` and usage; the stream is Anthropic's events
(messages_stream.py); errors are {"type": "error", "error": {"type", "message"}} with Anthropic's types
and statuses (overload is 529 `overloaded_error`, with retry-after). Headers: `anthropic-version` and
`anthropic-beta` are accepted whatever they say (no beta changes what this server does: the betas Claude
Code sends name features it only uses when the server offers them, or that the fields above cover).
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from openalice_runner.providers.base import CallContext
from openalice_runner.server.body import parse_json_body
from openalice_runner.server.context import turn_context
from openalice_runner.server.deadline import ClientGone, race, request_deadline
from openalice_runner.server.errors import APIError
from openalice_runner.server.mapping import api_error_from
from openalice_runner.server.runner_protocol import ServedRunner
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.validation import ServerChatRequest, check_request
from openalice_runner.server.wires.base import WireCall
from openalice_runner.server.wires.messages_reply import (
    MessageState,
    error_body,
    error_event,
    message,
    new_message_id,
)
from openalice_runner.server.wires.messages_request import CountTokensRequest, MessagesRequest, parse
from openalice_runner.server.wires.messages_stream import MessagesStream
from openalice_runner.server.wires.messages_translate import (
    Translated,
    anthropic_param,
    chat_request,
    conversation,
    to_chat,
)
from openalice_runner.types import ChatResult


class MessagesWire:
    name = "messages"

    async def read(self, request: Request, settings: ServerSettings) -> WireCall:
        raw = await request.body()
        content_type = request.headers.get("content-type")
        headers = dict(request.headers)
        return await anyio.to_thread.run_sync(self._read, raw, content_type, headers, settings.max_tokens_limit)

    def _read(self, raw: bytes, content_type: str | None, headers: dict[str, str], limit: int) -> WireCall:
        request: MessagesRequest = parse(MessagesRequest, parse_json_body(raw, content_type))
        if request.max_tokens > limit:
            raise _invalid("max_tokens", f"{request.max_tokens} is more than this server allows ({limit})")
        translated = to_chat(request)
        body = checked(translated, limit)
        conversation_id, source = conversation(headers, request)
        return WireCall(
            body=body,
            conversation_id=conversation_id,
            conversation_source=source,
            state=MessageState(model=request.model, stop_sequences=request.stop_sequences or []),
        )

    def reply(self, result: ChatResult, call: WireCall) -> Response:
        return JSONResponse(message(result, call.state), headers=call.headers or None)

    def stream_format(self, call: WireCall) -> MessagesStream:
        return MessagesStream(call.state, message_id=new_message_id())

    def error_body(self, error: APIError) -> tuple[int, dict[str, Any], dict[str, str]]:
        return error_body(error)

    def stream_error(self, error: APIError) -> bytes:
        return error_event(error)


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def checked(translated: Translated, max_tokens_limit: int) -> ServerChatRequest:
    """The chat request, validated and checked as the chat route checks its own (server/validation.py),
    each error named by the Anthropic field it came from."""
    body = chat_request(translated)
    try:
        check_request(body, max_tokens_limit=max_tokens_limit)
    except APIError as exc:
        param = anthropic_param(exc.param or "", translated)
        detail = exc.message.split(": ", 1)[-1]
        raise _invalid(param, detail) from None
    return body


# ---------------------------------------------------------------- count_tokens


def read_count_tokens(raw: bytes, content_type: str | None, max_tokens_limit: int) -> ServerChatRequest:
    request: CountTokensRequest = parse(CountTokensRequest, parse_json_body(raw, content_type))
    return checked(to_chat(request), max_tokens_limit)


class CountTokens:
    """POST /v1/messages/count_tokens: the prompt's tokens as the model that would serve it counts them.

    Where the route's first provider builds its prompts here (the embedded engine), its own prompt is
    counted, exactly and without generating. Elsewhere (a vLLM or SGLang pool, a hosted API) the prompt
    is run for one token and its usage read: exact too, and it warms the prefix cache for the call that
    usually follows, at the cost of one admission slot for one prefill."""

    def __init__(self, runner: ServedRunner, settings: ServerSettings) -> None:
        self.runner = runner
        self.settings = settings

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        content_type = request.headers.get("content-type")
        limit = self.settings.max_tokens_limit
        body = await anyio.to_thread.run_sync(read_count_tokens, raw, content_type, limit)
        tc = turn_context(request.headers, None)
        deadline = request_deadline(request.headers, None, self.settings.request_timeout_s)
        try:
            tokens = await race(self._count(body, tc.turn_type), deadline, request.receive)
        except ClientGone:
            return Response(status_code=499)
        except APIError:
            raise
        except Exception as exc:
            raise api_error_from(exc) from exc
        return JSONResponse({"input_tokens": tokens})

    async def _count(self, body: ServerChatRequest, turn_type: str) -> int:
        provider = self._first_provider(turn_type, body.model)
        build_prompt = getattr(provider, "build_prompt", None)
        if build_prompt is not None:
            return await anyio.to_thread.run_sync(lambda: len(build_prompt(body).ids))
        # one token, free: no forced call or format, whose grammar may need more than one token
        probe = body.model_copy(update={"max_tokens": 1, "tool_choice": None, "response_format": None})
        result = await self.runner.chat(probe, CallContext(turn_type=turn_type, model=body.model))
        if result.usage is None:  # the provider's server sent no usage: the count is unknown, never 0
            raise APIError(502, "the provider reported no usage for the prompt, so its tokens cannot be counted",
                           code="bad_response")
        return result.usage.prompt_tokens

    def _first_provider(self, turn_type: str, model: str | None) -> Any:
        route_for = getattr(self.runner, "route_for", None)
        if route_for is None:
            return None
        route = route_for(turn_type, model)  # UnknownModelError: 404, as on /v1/messages
        return self.runner.providers.get(route.chain[0])


MESSAGES = MessagesWire()

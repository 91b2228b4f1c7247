"""Checks on a chat request past its schema, done before any work: each problem is a 400 naming the field.

The schema (openalice_runner/types/) checks each field; here the request as a whole: tool messages
answer calls the conversation made, strings are valid Unicode (JSON can carry lone surrogates, which
no tokenizer takes), max_tokens is not absurd. The body field `timeout` is the sidecar's own
(see server/deadline.py); everything else is OpenAI's.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from openalice_runner.server.errors import APIError
from openalice_runner.types import ChatRequest


class ServerChatRequest(ChatRequest):
    """OpenAI's request body plus `timeout`: the seconds the caller will wait (capped by the server)."""

    timeout: float | None = Field(default=None, gt=0, le=86_400)


def check_request(body: ChatRequest, *, max_tokens_limit: int) -> None:
    _check_max_tokens(body, max_tokens_limit)
    _check_tool_messages(body)
    _check_history_arguments(body)
    _check_unicode(body)


def _invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def _check_max_tokens(body: ChatRequest, limit: int) -> None:
    if body.max_tokens is not None and body.max_tokens > limit:
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise _invalid(param, f"{body.max_tokens} is more than this server allows ({limit})")


def _check_tool_messages(body: ChatRequest) -> None:
    """A tool message answers a call of the assistant message before it (OpenAI's rule), once."""
    open_calls: set[str] = set()
    for i, message in enumerate(body.messages):
        if message.role == "assistant":
            open_calls = {call.id for call in message.tool_calls or ()}
        elif message.role == "tool":
            if message.tool_call_id not in open_calls:
                raise _invalid(
                    f"messages[{i}].tool_call_id",
                    f"{message.tool_call_id!r} answers no tool call of the preceding assistant message",
                )
            open_calls.discard(message.tool_call_id)
        else:
            open_calls = set()


# Nesting a history call's arguments may have: far above any real call (a tool schema may nest 64
# levels: schema_limits), far below what a recursive JSON parser survives. "[" x 5,000 crashed the
# prompt's rendering (RecursionError: a 500 and a traceback per request).
MAX_ARGUMENT_DEPTH = 128
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _check_history_arguments(body: ChatRequest) -> None:
    """The arguments of the calls in the history are JSON nested at most MAX_ARGUMENT_DEPTH deep."""
    for i, message in enumerate(body.messages):
        for j, call in enumerate(message.tool_calls or ()):
            if nested_too_deep(call.function.arguments):
                raise _invalid(
                    f"messages[{i}].tool_calls[{j}].function.arguments",
                    f"nested more than {MAX_ARGUMENT_DEPTH} levels deep",
                )


def nested_too_deep(text: str, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Whether `text`'s brackets (outside JSON strings) nest more than `limit` deep, counted without
    recursion. Cheap where it matters: most arguments hold fewer brackets than the limit."""
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > limit:
                return True
        elif token in ("]", "}"):
            depth -= 1
    return False


def _check_unicode(body: ChatRequest) -> None:
    bad = first_bad_string(body.model_dump(exclude_none=True, exclude={"timeout"}), "")
    if bad is not None:
        raise _invalid(bad or "body", "not valid Unicode (a lone surrogate escape)", code="invalid_unicode")


def first_bad_string(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = first_bad_string(key, path) or first_bad_string(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = first_bad_string(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None

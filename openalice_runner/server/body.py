"""The chat request body, parsed and validated in a worker thread.

Validating a request runs jsonschema's meta-schema check over every tool schema, in Python: 2 s for
a schema of 10,000 properties, which on the event loop stalled /health and every stream for as
long. In a thread the loop keeps answering; the errors are those FastAPI's own body parsing gives
(the same handlers turn them into OpenAI's 400s).
"""

from __future__ import annotations

import email.message
import json
from typing import Any

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from openalice_runner.server.errors import APIError, utf8_error
from openalice_runner.server.validation import ServerChatRequest, check_request

NOT_AN_OBJECT = "request body must be a JSON object (Content-Type: application/json)"


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True  # as FastAPI: no Content-Type is read as JSON
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    """`raw` as JSON (any value: the wire checks its shape); RequestValidationError or APIError otherwise."""
    if not raw or not _is_json(content_type):
        raise APIError(400, NOT_AN_OBJECT, code="invalid_body")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise utf8_error(exc) from None
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {},
              "ctx": {"error": exc.msg}}]  # fmt: skip
        ) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to parse", code="invalid_json") from None


def parse_chat_request(raw: bytes, content_type: str | None) -> ServerChatRequest:
    """`raw` as a ServerChatRequest; RequestValidationError or APIError otherwise."""
    data = parse_json_body(raw, content_type)
    try:
        return ServerChatRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to validate", code="invalid_value") from None


def _parse_and_check(raw: bytes, content_type: str | None, max_tokens_limit: int) -> ServerChatRequest:
    body = parse_chat_request(raw, content_type)
    check_request(body, max_tokens_limit=max_tokens_limit)
    return body


async def read_chat_request(request: Request, *, max_tokens_limit: int) -> ServerChatRequest:
    """The body, parsed, validated and checked as a whole (server/validation.py) in one worker thread
    hop: each hop costs the request path a thread handoff both ways."""
    raw = await request.body()
    return await anyio.to_thread.run_sync(_parse_and_check, raw, request.headers.get("content-type"), max_tokens_limit)

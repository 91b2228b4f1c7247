"""The Anthropic Messages wire's answers: the reply `message`, its stop reason and usage, and errors in
Anthropic's shape (types and statuses)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from openalice_runner.server.errors import APIError
from openalice_runner.types import ChatResult, Usage


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic sends them: `event: NAME` and `data: JSON`."""
    return f"event: {name}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


# Anthropic's error type by status (https://docs.anthropic.com/en/api/errors).
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for "overloaded, retry": clients back off and retry it
_CONTEXT = re.compile(r"(\d+) tokens\D+?(\d+) tokens")


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class MessageState:
    """What the wire keeps of the request to answer it."""

    def __init__(self, *, model: str, stop_sequences: list[str]) -> None:
        self.model = model
        self.stop_sequences = stop_sequences


def error_body(error: APIError) -> tuple[int, dict[str, Any], dict[str, str]]:
    status, kind = _status_and_type(error)
    headers = dict(error.headers or {})
    return status, {"type": "error", "error": {"type": kind, "message": _message_of(error)}}, headers


def error_event(error: APIError) -> bytes:
    _, kind = _status_and_type(error)
    return event("error", {"type": "error", "error": {"type": kind, "message": _message_of(error)}})


def _status_and_type(error: APIError) -> tuple[int, str]:
    status = error.status_code
    if error.code == "server_busy" or status == 503:
        # the server is full (admission) or going away: Anthropic's "overloaded", which clients retry
        return OVERLOADED, "overloaded_error"
    kind = _TYPE_BY_STATUS.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return status, kind


def _message_of(error: APIError) -> str:
    if error.code == "context_length_exceeded":
        # Anthropic's own words, which Claude Code recognises (and then offers to compact)
        found = _CONTEXT.search(error.message)
        if found:
            return f"prompt is too long: {found.group(1)} tokens > {found.group(2)} maximum"
        return f"prompt is too long: {error.message}"
    return error.message


def stop_reason(finish_reason: str | None, tool_used: bool) -> str:
    """OpenAI's finish reason as Anthropic's stop_reason. A stop string's stop is `end_turn` with no
    `stop_sequence`: the providers do not say which string matched (docs/agent-runtimes.md)."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use"
    return "end_turn"


def usage(u: Usage | None) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache;
    cache_read_input_tokens those the prefix cache served (left out where the provider does not say)."""
    if u is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else None
    out: dict[str, Any] = {
        "input_tokens": max(0, u.prompt_tokens - (cached or 0)),
        "output_tokens": u.completion_tokens,
    }
    if cached is not None:
        out["cache_creation_input_tokens"] = 0
        out["cache_read_input_tokens"] = cached
    return out


def tool_input(arguments: str, *, cut: bool) -> dict[str, Any]:
    """A call's arguments as tool_use's `input` (an object). A call the budget cut is `{}`: its
    stop_reason, max_tokens, says it is not to run."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    if cut:
        return {}
    raise APIError(502, "the model's tool call arguments are not a JSON object", code="bad_response")


def message(result: ChatResult, state: MessageState) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if result.content:
        content.append({"type": "text", "text": result.content})
    cut = result.finish_reason == "length"
    for call in result.tool_calls:
        content.append(
            {
                "type": "tool_use",
                "id": call.id,
                "name": call.function.name,
                "input": tool_input(call.function.arguments, cut=cut),
            }
        )
    out: dict[str, Any] = {
        "id": new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": result.model,
        "content": content,
        "stop_reason": stop_reason(result.finish_reason, bool(result.tool_calls)),
        "stop_sequence": None,
        "usage": usage(result.usage),
    }
    for key in ("speculation", "provider", "fallback_from"):  # the runner's extensions, as on Chat
        value = getattr(result, key)
        if value is not None:
            out[key] = value.model_dump() if hasattr(value, "model_dump") else value
    return out

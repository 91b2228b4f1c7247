"""A ChatResult -> OpenAI's Response object (`openai/types/responses/response.py`).

`output`: a `message` item with one `output_text` part (where the model wrote text, or wrote nothing and
called nothing), then a `function_call` item per tool call (a namespaced function named back as
`name` + `namespace`). `status`: `completed`, or `incomplete` with `incomplete_details.reason`
`max_output_tokens` (the budget ran out) / `content_filter`. `usage` in the Responses names, with
`input_tokens_details.cached_tokens` from the provider's prefix reuse. The request's settings are
echoed as OpenAI echoes them. Runner extensions (`speculation`, `provider`, `fallback_from`,
`tools_not_offered`) are extra top-level keys, left out when unset.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from openalice_runner.server.wires.responses import schema as s
from openalice_runner.server.wires.responses.translate import ToolName
from openalice_runner.types import ChatResult, FinishReason, SpeculationInfo, Usage

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_id(prefix: str) -> str:
    """OpenAI's id shapes: resp_, msg_, fc_ and 48 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


def status_of(finish_reason: FinishReason | None) -> tuple[str, dict[str, str] | None]:
    reason = _INCOMPLETE.get(finish_reason or "")
    return ("incomplete", {"reason": reason}) if reason else ("completed", None)


def usage_of(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    details = usage.prompt_tokens_details
    return {
        "input_tokens": usage.prompt_tokens,
        # cache writes are not counted by the providers: 0, as OpenAI reports where it wrote none
        "input_tokens_details": {
            "cached_tokens": details.cached_tokens if details else 0,
            "cache_write_tokens": 0,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if status == "in_progress" else [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    item_id: str, call_id: str, seen_name: str, arguments: str, status: str, names: dict[str, ToolName]
) -> dict[str, Any]:
    name = names.get(seen_name, ToolName(seen_name))
    item: dict[str, Any] = {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name.name,
        "arguments": arguments,
    }
    if name.namespace is not None:
        item["namespace"] = name.namespace
    return item


@dataclass
class ResponseShell:
    """One response's fixed parts (id, creation time, the request's settings echoed); `render` fills in
    what the generation decided."""

    echo: dict[str, Any]
    model: str | None
    tools_not_offered: list[str] = field(default_factory=list)
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def render(
        self,
        *,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        incomplete_details: dict[str, str] | None = None,
        error: dict[str, Any] | None = None,
        model: str | None = None,
        speculation: SpeculationInfo | None = None,
        provider: str | None = None,
        fallback_from: list[str] | None = None,
    ) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete_details,
            "model": model or self.model or "",
            "output": output,
            "usage": usage,
            **self.echo,
        }
        if status in ("completed", "incomplete", "failed"):
            data["completed_at"] = int(time.time()) if status != "failed" else None
        if speculation is not None:
            data["speculation"] = speculation.model_dump()
        if provider is not None:
            data["provider"] = provider
        if fallback_from is not None:
            data["fallback_from"] = fallback_from
        if self.tools_not_offered:
            data["tools_not_offered"] = self.tools_not_offered
        return data


def shell_of(body: s.ResponsesRequest, tools_not_offered: list[str]) -> ResponseShell:
    """The request's settings as OpenAI echoes them in the Response (defaults filled in)."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    text.setdefault("format", {"type": "text"})
    echo = {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "prompt_cache_key": body.prompt_cache_key,
        "reasoning": (body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None}),
        "safety_identifier": body.safety_identifier,
        "service_tier": "default",
        "store": True if body.store is None else body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": text,
        "tool_choice": _dump(body.tool_choice) if body.tool_choice is not None else "auto",
        "tools": [_dump(t) for t in body.tools or ()],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "background": False,
    }
    return ResponseShell(echo, body.model, tools_not_offered)


def _dump(value: Any) -> Any:
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


def output_of(result: ChatResult, names: dict[str, ToolName]) -> list[dict[str, Any]]:
    status, _ = status_of(result.finish_reason)
    items: list[dict[str, Any]] = []
    text = result.content or ""
    if text or not result.tool_calls:
        items.append(message_item(new_id("msg"), text, status))
    for call in result.tool_calls:
        items.append(function_call_item(
            new_id("fc"), call.id, call.function.name, call.function.arguments, "completed", names
        ))  # fmt: skip
    return items


def response_of(shell: ResponseShell, result: ChatResult, names: dict[str, ToolName]) -> dict[str, Any]:
    """The whole Response for a finished generation."""
    status, incomplete = status_of(result.finish_reason)
    return shell.render(
        status=status,
        output=output_of(result, names),
        usage=usage_of(result.usage),
        incomplete_details=incomplete,
        model=result.model,
        speculation=result.speculation,
        provider=result.provider,
        fallback_from=result.fallback_from,
    )

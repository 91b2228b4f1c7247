"""An Anthropic Messages request (messages_request.py) as the chat request every provider serves, and the
conversation its session keys name. What each field becomes is in messages_request.py's docstring."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from openalice_runner.server.errors import APIError
from openalice_runner.server.validation import ServerChatRequest
from openalice_runner.server.wires.base import session_key
from openalice_runner.server.wires.messages_request import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlock,
    SearchResultBlock,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from openalice_runner.types import FieldError

SESSION_HEADER = "x-claude-code-session-id"
# Claude Code's first system block: a per-request attribution line (a hash that changes every call),
# no instruction to the model. Left out, as vLLM does, so the prompt's prefix stays the same and cached.
_BILLING_HEADER = "x-anthropic-billing-header"


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class Translated:
    chat: dict[str, Any]  # the chat request's body (ServerChatRequest)
    origin: list[str]  # chat message index -> the Anthropic field it came from ("system", "messages.3")


def to_chat(request: MessagesRequest | CountTokensRequest) -> Translated:
    messages: list[dict[str, Any]] = []
    origin: list[str] = []
    system = _system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
        origin.append("system")
    _check_turns(request.messages)
    for i, message in enumerate(request.messages):
        for chat_message in _message(message, i):
            messages.append(chat_message)
            origin.append(f"messages.{i}")
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.tools:
        chat["tools"] = [_tool(t) for t in request.tools]
    if request.tool_choice is not None:
        chat.update(_tool_choice(request.tool_choice))
    output = request.output_config
    if output is not None and output.format is not None:
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": output.format.schema_},
        }
    if isinstance(request, MessagesRequest):
        chat.update(_sampling(request))
    return Translated(chat, origin)


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    """tool_choice (and parallel_tool_calls) in Chat's terms."""
    out: dict[str, Any] = {}
    if choice.type == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _sampling(request: MessagesRequest) -> dict[str, Any]:
    """A Messages request's budget, streaming and sampling in Chat's terms (count_tokens has none)."""
    out: dict[str, Any] = {"max_tokens": request.max_tokens, "stream": request.stream}
    if request.stream:
        out["stream_options"] = {"include_usage": True}
    for name, value in (
        ("temperature", request.temperature),
        ("top_p", request.top_p),
        ("top_k", request.top_k),
        ("stop", request.stop_sequences),
    ):
        if value is not None:
            out[name] = value
    return out


def chat_request(translated: Translated) -> ServerChatRequest:
    """The chat request, validated; its errors named by the Anthropic field they came from."""
    try:
        return ServerChatRequest.model_validate(translated.chat)
    except ValidationError as exc:
        raise _chat_error(exc, translated) from None


def conversation(headers: Mapping[str, str], request: MessagesRequest) -> tuple[str | None, str | None]:
    """Claude Code's session: its X-Claude-Code-Session-Id header, else metadata.user_id when that is a
    JSON object holding `session_id` (Claude Code's form). (id, the key it came from)."""
    found = session_key(headers.get(SESSION_HEADER))
    if found is not None:
        return found, SESSION_HEADER
    user_id = request.metadata.user_id if request.metadata is not None else None
    if user_id and user_id.lstrip().startswith("{"):
        try:
            data = json.loads(user_id)
        except ValueError:
            return None, None
        found = session_key(data.get("session_id")) if isinstance(data, dict) else None
        if found is not None:
            return found, "metadata.user_id.session_id"
    return None, None


# ---------------------------------------------------------------- pieces


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n".join(b.text for b in system if b.text and not b.text.startswith(_BILLING_HEADER))


def _message(message: MessageParam, i: int) -> list[dict[str, Any]]:
    role, content = message.role, message.content
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":
        text = "\n".join(
            b.text for b in content if isinstance(b, TextBlock) and not b.text.startswith(_BILLING_HEADER)
        )
        _only(content, i, (TextBlock,), "a system message")
        return [{"role": "system", "content": text}] if text else []
    if role == "assistant":
        return [_assistant(content, i)]
    return _user(content, i)


def _only(content: list[Any], i: int, kinds: tuple[type, ...], where: str) -> None:
    for j, block in enumerate(content):
        _no_media(block, f"messages.{i}.content.{j}")
        if not isinstance(block, kinds + (ThinkingBlock, RedactedThinkingBlock)):
            raise _invalid(f"messages.{i}.content.{j}.type", f"a {block.type} block cannot be in {where}")


def _no_media(block: Any, param: str) -> None:
    if isinstance(block, ImageBlock | DocumentBlock):
        raise _invalid(
            param, f"{block.type} blocks are not supported: the model this server runs reads text only"
        )


def _assistant(content: list[Any], i: int) -> dict[str, Any]:
    _only(content, i, (TextBlock, ToolUseBlock), "an assistant message")
    text = "".join(b.text for b in content if isinstance(b, TextBlock))
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
        }
        for b in content
        if isinstance(b, ToolUseBlock)
    ]
    out: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out


def _user(content: list[Any], i: int) -> list[dict[str, Any]]:
    """Tool results first (as tool messages, answering the calls before them), then the text."""
    _only(content, i, (TextBlock, ToolResultBlock, SearchResultBlock), "a user message")
    out: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block, i, j)})
    text = "".join(_search_text(b) if isinstance(b, SearchResultBlock) else b.text for b in content
                   if isinstance(b, TextBlock | SearchResultBlock))  # fmt: skip
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _result_text(block: ToolResultBlock, i: int, j: int) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for k, part in enumerate(content):
            _no_media(part, f"messages.{i}.content.{j}.content.{k}")
            if isinstance(part, TextBlock):
                texts.append(part.text)
            elif isinstance(part, SearchResultBlock):
                texts.append(_search_text(part))
            elif isinstance(part, ToolReferenceBlock):
                texts.append(f"Tool loaded: {part.tool_name}")
        text = "\n".join(texts)
    # The chat request has no field for a failed call: the model reads it in the result.
    return f"Error: {text}" if block.is_error else text


def _search_text(block: SearchResultBlock) -> str:
    return "\n".join([f"{block.title} ({block.source})", *(t.text for t in block.content)])


def _check_turns(messages: list[MessageParam]) -> None:
    """Anthropic's rules of a conversation: each tool_result answers a tool_use of the assistant message
    right before it, each tool_use is answered in the message right after it, and the last message is
    the user's (assistant prefill is not supported by the models served)."""
    open_calls: dict[str, int] = {}  # tool_use id -> its assistant message's index
    last = -1
    for i, message in enumerate(messages):
        if message.role == "system":
            continue
        blocks = message.content if isinstance(message.content, list) else []
        if message.role == "user":
            answered = set()
            for j, block in enumerate(blocks):
                if isinstance(block, ToolResultBlock):
                    if block.tool_use_id not in open_calls:
                        raise _invalid(
                            f"messages.{i}.content.{j}.tool_use_id",
                            f"unexpected tool_use_id found in tool_result blocks: {block.tool_use_id}. Each "
                            "tool_result block must have a corresponding tool_use block in the previous message.",
                        )
                    answered.add(block.tool_use_id)
            missing = [cid for cid in open_calls if cid not in answered]
        else:
            missing = list(open_calls)
        if missing:
            raise _invalid(
                f"messages.{open_calls[missing[0]]}",
                f"tool_use ids were found without tool_result blocks immediately after: {', '.join(missing)}. "
                "Each tool_use block must have a corresponding tool_result block in the next message.",
            )
        open_calls = {b.id: i for b in blocks if isinstance(b, ToolUseBlock)} if message.role == "assistant" else {}
        last = i
    if last < 0:
        raise _invalid("messages", "at least one user or assistant message is required")
    if messages[last].role == "assistant":
        raise _invalid(
            f"messages.{last}",
            "this model does not support assistant message prefill; the conversation must end with a user message",
        )


def _tool(tool: Any) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


# ---------------------------------------------------------------- errors of the chat request

_TOOL_FIELD = re.compile(r"^tools\.(\d+)\.function\.(name|parameters|description|strict)")
_CHAT_FIELD = {"name": "name", "parameters": "input_schema", "description": "description", "strict": "strict"}
_PLAIN = {"max_tokens": "max_tokens", "stop": "stop_sequences", "tool_choice": "tool_choice",
          "response_format": "output_config.format"}  # fmt: skip


def _chat_error(exc: ValidationError, translated: Translated) -> APIError:
    """A check of the chat request that the Anthropic schema does not make (a tool name longer than
    64 characters, a tool schema that is no JSON Schema, ...), named by the Anthropic field."""
    first = exc.errors(include_url=False)[0]
    field_error = (first.get("ctx") or {}).get("error")
    if isinstance(field_error, FieldError):
        chat_param, msg = field_error.param, str(field_error)
    else:
        chat_param = ".".join(str(p) for p in first.get("loc", ()) if not _is_tag(p))
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return _invalid(anthropic_param(chat_param, translated), msg)


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and (part.startswith("function-") or "[" in part or part in {"str"})


def anthropic_param(chat_param: str, translated: Translated) -> str:
    tool = _TOOL_FIELD.match(chat_param)
    if tool:
        return f"tools.{tool.group(1)}.{_CHAT_FIELD[tool.group(2)]}"
    message = re.match(r"^messages[.\[](\d+)", chat_param)
    if message and int(message.group(1)) < len(translated.origin):
        return translated.origin[int(message.group(1))]
    head = chat_param.split(".")[0].split("[")[0]
    return _PLAIN.get(head, head or "body")

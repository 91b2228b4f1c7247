"""A Responses body -> the chat request the sidecar runs (ServerChatRequest), with what the reply needs.

- `instructions` -> a leading system message (not carried over from a previous response, as OpenAI says);
- `input` items -> messages: `message` (any role; text parts joined), `function_call` (an assistant tool
  call; consecutive calls share one assistant message), `function_call_output` (a tool message),
  `reasoning` (accepted, not shown: the model produced none);
- `previous_response_id` -> that response's conversation (input and output) before the new input;
- `function` tools as they are; `namespace` tools flattened to `<namespace>__<name>` (as vLLM shows
  them), mapped back on the way out; hosted tools left out and named (`tools_not_offered`);
- `tool_choice`, `text.format`, `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls`,
  `metadata` -> their chat counterparts.
Every problem is an APIError naming the Responses field, checked here before the chat model sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from openalice_runner.server.errors import APIError
from openalice_runner.server.validation import MAX_ARGUMENT_DEPTH, ServerChatRequest, nested_too_deep
from openalice_runner.server.wires.responses import schema as s
from openalice_runner.server.wires.responses.errors import invalid, param_of
from openalice_runner.types import (
    AllowedToolChoice,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolDefinition,
)

NAMESPACE_SEPARATOR = "__"  # vLLM's: `<namespace>__<name>`
_LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True)
class ToolName:
    """A function as the caller named it: `name`, inside `namespace` where it came in one."""

    name: str
    namespace: str | None = None


@dataclass
class Translation:
    request: ServerChatRequest
    conversation: list[ChatMessage]  # the messages without `instructions`: what a later response continues
    tool_names: dict[str, ToolName] = field(default_factory=dict)  # name the model sees -> the caller's
    tools_not_offered: list[str] = field(default_factory=list)  # hosted tool types left out


def to_chat(
    body: s.ResponsesRequest,
    *,
    previous: list[ChatMessage] | None = None,
    max_tokens_limit: int | None = None,
) -> Translation:
    """`previous`: the stored conversation `previous_response_id` names (the caller looks it up)."""
    _refuse_unsupported(body)
    tools, names, left_out = _tools(body.tools or [])
    conversation = _messages(body.input, names, list(previous or []))
    messages = (
        [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    ) + conversation
    if not messages:
        raise invalid(
            "input", "no input: send `input` (a string or items)", code="missing_required_parameter"
        )
    if (
        max_tokens_limit is not None
        and body.max_output_tokens is not None
        and body.max_output_tokens > max_tokens_limit
    ):
        raise invalid(
            "max_output_tokens",
            f"{body.max_output_tokens} is more than this server allows ({max_tokens_limit})",
        )
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": _tool_choice(body.tool_choice, tools, names),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body.text),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "metadata": body.metadata,
    }
    try:
        request = ServerChatRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # checked above field by field; what is left is a fault of this module
        raise APIError(500, f"internal error translating the request ({exc.error_count()} problems)",
                       code="internal_error") from exc  # fmt: skip
    return Translation(request, conversation, names, left_out)


def _refuse_unsupported(body: s.ResponsesRequest) -> None:
    if body.background:
        raise invalid(
            "background",
            "background responses are not supported by this server",
            code="unsupported_parameter",
        )
    if body.conversation is not None:
        raise invalid("conversation", "conversations are not supported by this server; send previous_response_id "
                      "or the whole input", code="unsupported_parameter")  # fmt: skip
    if body.prompt is not None:
        raise invalid(
            "prompt", "prompt templates are not supported by this server", code="unsupported_parameter"
        )
    if body.top_logprobs:
        raise invalid(
            "top_logprobs", "logprobs are not supported by this server", code="unsupported_parameter"
        )
    for i, name in enumerate(body.include or ()):
        if name == _LOGPROBS_INCLUDE:
            raise invalid(
                f"include[{i}]", "logprobs are not supported by this server", code="unsupported_parameter"
            )


# ---------------------------------------------------------------- input


def _messages(
    items: str | list[Any] | None, names: dict[str, ToolName], history: list[ChatMessage]
) -> list[ChatMessage]:
    """`history` (a previous response's conversation) and then `items`, as chat messages."""
    out = history
    if items is None:
        return out
    if isinstance(items, str):
        return [*out, ChatMessage(role="user", content=items)]
    flat = {(n.namespace, n.name): seen for seen, n in names.items()}
    open_calls = _unanswered(history)  # calls of the latest assistant message not yet answered
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, s.MessageItem):
            out.append(_message(item, where))
            open_calls = set()
        elif isinstance(item, s.FunctionCallItem):
            call = ToolCall(id=item.call_id, function=_call(item, flat, where))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and (last.tool_calls or not open_calls):
                last.tool_calls = [*(last.tool_calls or []), call]  # one assistant turn, text then calls
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            open_calls.add(item.call_id)
        elif isinstance(item, s.FunctionCallOutputItem):
            if item.call_id not in open_calls:
                raise invalid(f"{where}.call_id", f"no function_call with call_id {item.call_id!r} precedes this output "
                              "(since the last message)")  # fmt: skip
            open_calls.discard(item.call_id)
            out.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=item.call_id,
                    content=_output_text(item.output, f"{where}.output"),
                )
            )
        elif isinstance(item, s.ReasoningItem):
            continue  # not shown to the model; it keeps the calls around it in one turn
        else:
            raise invalid(
                f"{where}.type", f"input items of type {item.type!r} are not supported by this server"
            )
    return out


def _unanswered(history: list[ChatMessage]) -> set[str]:
    """The calls the history's last assistant message made that no tool message after it answers: the
    new input's `function_call_output` items may answer them (a previous response's calls)."""
    answered: set[str] = set()
    for message in reversed(history):
        if message.role == "tool":
            answered.add(message.tool_call_id or "")
            continue
        if message.role == "assistant":
            return {call.id for call in message.tool_calls or ()} - answered
        break
    return set()


def _message(item: s.MessageItem, where: str) -> ChatMessage:
    if isinstance(item.content, str):
        return ChatMessage(role=item.role, content=item.content)
    texts: list[str] = []
    for j, part in enumerate(item.content):
        at = f"{where}.content[{j}]"
        if isinstance(part, s.MediaPart):
            raise invalid(
                at, f"{part.type!r} content needs a model that reads it; this server's models read text only"
            )
        allowed = ("output_text", "refusal") if item.role == "assistant" else ("input_text",)
        if part.type not in allowed:
            raise invalid(f"{at}.type", f"a {item.role} message holds {' or '.join(map(repr, allowed))} parts, "
                          f"not {part.type!r}")  # fmt: skip
        texts.append(part.refusal if isinstance(part, s.Refusal) else part.text)
    return ChatMessage(role=item.role, content="".join(texts))


def _call(item: s.FunctionCallItem, flat: dict[tuple[str | None, str], str], where: str) -> FunctionCall:
    if nested_too_deep(item.arguments):  # the prompt's rendering parses them: keep it from recursing without end
        raise invalid(f"{where}.arguments", f"nested more than {MAX_ARGUMENT_DEPTH} levels deep")
    name = flat.get((item.namespace, item.name))
    if name is None:  # a tool not offered this time: shown as the model would have seen it
        name = f"{item.namespace}{NAMESPACE_SEPARATOR}{item.name}" if item.namespace else item.name
    try:
        return FunctionCall(name=name, arguments=item.arguments)
    except ValidationError:
        raise invalid(f"{where}.name", f"{name!r} is not a valid function name (letters, digits, _ and -, "
                      "at most 64)") from None  # fmt: skip


def _output_text(output: str | list[Any], where: str) -> str:
    if isinstance(output, str):
        return output
    texts = []
    for j, part in enumerate(output):
        if isinstance(part, s.MediaPart):
            raise invalid(f"{where}[{j}]", f"{part.type!r} content needs a model that reads it; this server's "
                          "models read text only")  # fmt: skip
        texts.append(part.refusal if isinstance(part, s.Refusal) else part.text)
    return "".join(texts)


# ---------------------------------------------------------------- tools


def _tools(tools: list[Any]) -> tuple[list[ToolDefinition], dict[str, ToolName], list[str]]:
    out: list[ToolDefinition] = []
    names: dict[str, ToolName] = {}
    left_out: list[str] = []
    for i, tool in enumerate(tools):
        if isinstance(tool, s.FunctionTool):
            out.append(_function(tool, tool.name, f"tools[{i}]", names))
            names[tool.name] = ToolName(tool.name)
        elif isinstance(tool, s.NamespaceTool):
            for j, inner in enumerate(tool.tools):
                if not isinstance(inner, s.FunctionTool):
                    left_out.append(f"{tool.name}.{inner.type}")
                    continue
                seen = f"{tool.name}{NAMESPACE_SEPARATOR}{inner.name}"
                out.append(_function(inner, seen, f"tools[{i}].tools[{j}]", names))
                names[seen] = ToolName(inner.name, tool.name)
        else:
            left_out.append(tool.type)
    return out, names, left_out


def _function(tool: s.FunctionTool, name: str, where: str, names: dict[str, ToolName]) -> ToolDefinition:
    if name in names:
        raise invalid(f"{where}.name", f"duplicate function name {name!r}")
    fields: dict[str, Any] = {"name": name, "description": tool.description, "strict": tool.strict}
    if tool.parameters is not None:
        fields["parameters"] = tool.parameters
    try:
        return ToolDefinition(
            function=FunctionDefinition(**{k: v for k, v in fields.items() if v is not None})
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        sub = param_of(first.get("loc", ()))
        sub = "name" if sub == "name" else "parameters" if sub.startswith("parameters") else sub
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        if sub == "name":
            msg = f"{name!r} is not a valid function name (letters, digits, _ and -, at most 64)"
        raise invalid(f"{where}.{sub}" if sub else where, msg) from None


def _tool_choice(choice: Any, tools: list[ToolDefinition], names: dict[str, ToolName]) -> Any:
    if choice is None or choice == "auto":
        return "auto" if tools else None
    if choice == "none":
        return "none"
    if choice == "required":
        if not tools:
            raise invalid(
                "tool_choice", "'required' needs a function tool the model can call; tools has none"
            )
        return "required"
    if isinstance(choice, s.FunctionChoice):
        return NamedToolChoice(function={"name": _resolve(choice.name, names, "tool_choice.name")})
    if isinstance(choice, s.AllowedToolsChoice):
        allowed = [
            _resolve(t.get("name", ""), names, f"tool_choice.tools[{k}].name")
            for k, t in enumerate(choice.tools)
            if t.get("type") == "function"  # hosted tools allowed here are not offered anyway
        ]
        if not allowed:
            if choice.mode == "required":
                raise invalid("tool_choice.tools", "mode 'required' needs a function tool; these name none")
            return "none"
        return AllowedToolChoice(
            type="allowed_tools",
            allowed_tools={
                "mode": choice.mode,
                "tools": [{"function": {"name": n}} for n in dict.fromkeys(allowed)],
            },
        )
    kind = getattr(choice, "type", "?")
    raise invalid("tool_choice", f"forces the hosted tool {kind!r}, which this server cannot run")


def _resolve(name: str, names: dict[str, ToolName], where: str) -> str:
    """A function's name as the model sees it: the name itself, `<namespace>__<name>`, or a namespaced
    function's own name where only one namespace has it (as vLLM resolves it)."""
    if name in names:
        return name
    candidates = [seen for seen, n in names.items() if n.namespace is not None and n.name == name]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise invalid(
            where, f"{name!r} is in more than one namespace ({', '.join(candidates)}): name it in full"
        )
    raise invalid(where, f"{name!r} is not a function in tools")


def _response_format(text: s.TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or isinstance(fmt, s.TextFormatText):
        return None
    if isinstance(fmt, s.TextFormatJsonObject):
        return ResponseFormat(type="json_object")
    try:
        schema = JsonSchemaFormat.model_validate(
            {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        sub = "name" if first.get("loc", ("",))[0] == "name" else "schema"
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise invalid(f"text.format.{sub}", msg) from None
    return ResponseFormat(type="json_schema", json_schema=schema)

"""The Anthropic Messages request body (POST /v1/messages, /v1/messages/count_tokens), field for field as
Anthropic publishes it, and its translation onto the chat request every provider serves.

What each field means here (docs/agent-runtimes.md, "Messages", says it for users):
- `system` (string or text blocks) and `role: "system"` messages in `messages` become system messages
  where they stand; text blocks of one message are joined.
- `tool_use` blocks become the assistant message's tool calls, `tool_result` blocks tool messages (a
  string or text blocks; `is_error: true` is said in the content, "Error: ...", since the chat request
  has no field for it). A user message's text after its tool results follows them as a user message.
- `thinking` / `redacted_thinking` blocks in the history are accepted and not shown to the model (it
  does not think; its replies carry no thinking blocks).
- `image` / `document` blocks (also inside a tool_result): 400 naming the block: the models served are
  text-only.
- `cache_control` (on blocks, tools, system, top level): accepted; the prefix cache of the runner reuses
  any repeated prefix without being asked (usage's `cache_read_input_tokens` says how much it reused).
- `tools` (custom tools: `input_schema` an object schema; `strict` kept); `tool_choice` auto / any /
  tool / none, `disable_parallel_tool_use` (one call at most). Anthropic's server tools (`type` other
  than "custom": bash, text editor, web search, ...) are refused by name: the runner runs no tools.
- `stop_sequences`, `temperature` (0..1), `top_p`, `top_k`: sampling. `max_tokens`: the budget.
- `metadata.user_id`: a JSON string holding `session_id` (Claude Code's) names the conversation.
- `thinking` (enabled / adaptive / disabled), `output_config.effort`, `context_management`, `container`,
  `service_tier`, `speed`, `inference_geo`, `diagnostics`, `user_profile_id`, `workspace_id`: accepted
  and ignored (the model has no thinking budget or effort setting; the runtime's own compaction is what
  manages the context). `output_config.format` (`json_schema`): the reply is one JSON value of the schema
  (grammar-constrained, as Chat Completions' `response_format`).
- `mcp_servers` (non-empty): 400, the runner connects to no MCP server.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from openalice_runner.server.errors import APIError
from openalice_runner.types import FieldError

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Model(BaseModel):
    model_config = _STRICT


class CacheControl(_Model):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Model):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Model):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(_Model):
    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None


def _kind(value: Any) -> str:
    """The block's own type as the union's tag (so an error names the block type's fields); an unknown
    type gets the tag "unknown", whose error names the types there are."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"block:{kind}" if kind in _BLOCK_TYPES else "block:unknown"


def _result_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"block:{kind}" if kind in _RESULT_TYPES else "block:unknown"


class UnknownBlock(_Model):
    """Only here to fail: its error names the block types there are."""

    type: Literal[
        "text", "image", "document", "search_result", "tool_use", "tool_result", "thinking", "redacted_thinking"
    ]


class UnknownResultPart(_Model):
    type: Literal["text", "image", "document", "search_result", "tool_reference"]


class SearchResultBlock(_Model):
    """A search hit a tool returned: its title and text reach the model."""

    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolReferenceBlock(_Model):
    """Tool search's answer (a deferred tool to load): every tool is shown to the model anyway
    (`defer_loading` is ignored), so it reaches the model as the tool's name."""

    type: Literal["tool_reference"]
    tool_name: str
    cache_control: CacheControl | None = None


ResultPart = Annotated[
    Annotated[TextBlock, Tag("block:text")]
    | Annotated[ImageBlock, Tag("block:image")]
    | Annotated[DocumentBlock, Tag("block:document")]
    | Annotated[SearchResultBlock, Tag("block:search_result")]
    | Annotated[ToolReferenceBlock, Tag("block:tool_reference")]
    | Annotated[UnknownResultPart, Tag("block:unknown")],
    Discriminator(_result_kind),
]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: ResultContent | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    Annotated[TextBlock, Tag("block:text")]
    | Annotated[ImageBlock, Tag("block:image")]
    | Annotated[DocumentBlock, Tag("block:document")]
    | Annotated[ToolUseBlock, Tag("block:tool_use")]
    | Annotated[ToolResultBlock, Tag("block:tool_result")]
    | Annotated[ThinkingBlock, Tag("block:thinking")]
    | Annotated[RedactedThinkingBlock, Tag("block:redacted_thinking")]
    | Annotated[SearchResultBlock, Tag("block:search_result")]
    | Annotated[UnknownBlock, Tag("block:unknown")],
    Discriminator(_kind),
]
_BLOCK_TYPES = frozenset(
    {"text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking", "search_result"}
)
_RESULT_TYPES = frozenset({"text", "image", "document", "search_result", "tool_reference"})


def _form(value: Any) -> str:
    return "str" if isinstance(value, str) else "list"


# A string or a list of blocks: validated as the form it is, so an error names that form's fields.
Content = Annotated[Annotated[str, Tag("str")] | Annotated[list[Block], Tag("list")], Discriminator(_form)]
ResultContent = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ResultPart], Tag("list")], Discriminator(_form)
]
SystemContent = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[TextBlock], Tag("list")], Discriminator(_form)
]


class MessageParam(_Model):
    role: Literal["user", "assistant", "system"]
    content: Content


class Tool(_Model):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(
                f"tool type {kind!r} is one of Anthropic's server tools, which this server does not run; "
                "send it as a custom tool (name, description, input_schema)"
            )
        return data

    @model_validator(mode="after")
    def _object_schema(self) -> Tool:
        if self.input_schema.get("type") != "object":
            raise ValueError("input_schema must be a JSON schema of type 'object'")
        return self


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_fits_type(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("name is required for tool_choice type 'tool'")
        if self.type != "tool" and self.name is not None:
            raise ValueError(f"name is only allowed for tool_choice type 'tool', not {self.type!r}")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("disable_parallel_tool_use is not allowed for tool_choice type 'none'")
        return self


class Metadata(_Model):
    user_id: str | None = Field(default=None, max_length=512)


class ThinkingEnabled(_Model):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingOther(_Model):
    type: Literal["disabled", "adaptive"]
    display: Literal["summarized", "omitted"] | None = None


def _thinking_kind(value: Any) -> str:
    # any value (a float, a list): the union's tag only picks which model's error names the field
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "enabled" if kind == "enabled" else "other"


Thinking = Annotated[
    Annotated[ThinkingEnabled, Tag("enabled")] | Annotated[ThinkingOther, Tag("other")],
    Discriminator(_thinking_kind),
]


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class _Common(_Model):
    """What count_tokens and messages share."""

    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageParam] = Field(min_length=1)
    system: SystemContent | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None
    cache_control: CacheControl | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    speed: Literal["standard", "fast"] | None = None
    diagnostics: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @model_validator(mode="after")
    def _no_mcp(self) -> _Common:
        if self.mcp_servers:
            raise FieldError("mcp_servers", "this server connects to no MCP server; leave it out")
        return self


class CountTokensRequest(_Common):
    pass


class MessagesRequest(_Common):
    max_tokens: int = Field(ge=1)
    stream: bool = Field(default=False, strict=True)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    container: str | dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None

    @model_validator(mode="after")
    def _thinking_budget(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise FieldError("max_tokens", "max_tokens must be greater than thinking.budget_tokens")
        return self


def parse(model: type[_Common], data: Any) -> Any:
    """`data` as `model`; APIError naming the first wrong field in Anthropic's dotted terms
    (messages.1.content.0.text) otherwise."""
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply to validate", code="invalid_value") from None


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = field_path(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value"))
    field_error = (first.get("ctx") or {}).get("error")
    if isinstance(field_error, FieldError):  # a check of several fields that knows which is at fault
        param = ".".join(p for p in (param, field_error.param) if p)
        msg = str(field_error)
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if first.get("type") == "union_tag_invalid" or (first.get("type") == "literal_error" and param.endswith("type")):
        msg = f"{msg} (got {json.dumps(first.get('input'))[:60]})"
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param or None, code="invalid_value")


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """pydantic's ('messages', 1, 'content', 'list[...]', 0, 'block:text', 'text') ->
    'messages.1.content.0.text', as Anthropic's own errors name fields. Union members and tags are
    not field names and are left out."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif isinstance(p, str) and not (p.startswith("block:") or p in _UNION_MEMBERS or "[" in p):
            parts.append(p)
    return ".".join(parts)


_UNION_MEMBERS = frozenset({"str", "list", "enabled", "other", "function-after", "function-before"})

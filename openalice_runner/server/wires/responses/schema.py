"""The Responses request body, as OpenAI's API reference and the `openai` SDK's types
(`openai/types/responses/response_create_params.py`) have it.

An unknown field is refused naming itself (OpenAI: 400 `unknown_parameter`). Fields the runner accepts
without acting on them say so here; docs/agent-runtimes.md (Responses) has the table. Unions are told
apart by `type` (and `role`): the tags start with "@" so an error's field path can leave them out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from openalice_runner.config_files.models import StrictModel
from openalice_runner.types import MAX_MODEL_NAME

# Hosted tools run by OpenAI's servers (or built-in client tools a model must be trained for): the
# runner cannot run them, so they are left out of what the model sees and named in the reply.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "computer", "computer_use", "computer_use_preview",
    "image_generation", "mcp", "local_shell", "shell", "apply_patch", "tool_search", "custom",
})  # fmt: skip
MEDIA_PART_TYPES = frozenset({"input_image", "input_file", "input_audio"})


def _kind(value: Any) -> str | None:
    """A union member's `type`, where it is a string (a discriminator must not hash a list)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


class _Open(StrictModel):
    """Items the runner accepts in history without showing them to the model: their fields are
    OpenAI's to evolve, so only `type` is checked."""

    model_config = ConfigDict(extra="allow")
    type: str


# ---------------------------------------------------------------- content parts


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputText(StrictModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(StrictModel):
    type: Literal["refusal"]
    refusal: str


class MediaPart(_Open):
    """An image, file or audio part: refused by a text-only model, naming the part."""


def _part_tag(value: Any) -> str | None:
    kind = _kind(value)
    if kind in MEDIA_PART_TYPES:
        return "@media"
    return f"@{kind}" if kind in ("input_text", "output_text", "refusal") else None


ContentPart = Annotated[
    Annotated[InputText, Tag("@input_text")]
    | Annotated[OutputText, Tag("@output_text")]
    | Annotated[Refusal, Tag("@refusal")]
    | Annotated[MediaPart, Tag("@media")],
    Discriminator(
        _part_tag,
        custom_error_type="invalid_value",
        custom_error_message="content part type must be one of 'input_text', 'output_text', 'refusal', "
        "'input_image', 'input_file', 'input_audio'",
    ),
]


# ---------------------------------------------------------------- input items


class MessageItem(StrictModel):
    """EasyInputMessage, ResponseInputMessageItem and ResponseOutputMessage in one: a message of any role."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # assistant: "commentary" | "final_answer"; no meaning to the model here


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None  # the function's namespace tool, as the reply named it
    id: str | None = None
    status: str | None = None
    caller: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Open):
    """A reasoning item passed back (Codex sends them with `encrypted_content`): accepted, not shown to
    the model, which produced none."""


class OtherItem(_Open):
    """Any other item type (item_reference, computer_call, web_search_call, ...): refused by name."""


def _item_tag(value: Any) -> str:
    kind = _kind(value)
    if kind is None and (isinstance(value, dict) and "role" in value):
        return "@message"
    if kind in ("message", "function_call", "function_call_output", "reasoning"):
        return f"@{kind}"
    return "@other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("@message")]
    | Annotated[FunctionCallItem, Tag("@function_call")]
    | Annotated[FunctionCallOutputItem, Tag("@function_call_output")]
    | Annotated[ReasoningItem, Tag("@reasoning")]
    | Annotated[OtherItem, Tag("@other")],
    Discriminator(_item_tag),
]


# ---------------------------------------------------------------- tools


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # accepted with no meaning here: tool search, programmatic callers, async results, output schemas
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = None
    output_schema: dict[str, Any] | None = None
    async_: bool | None = Field(default=None, alias="async")


class CustomTool(_Open):
    """A free-form tool (`custom`): not offered to the model, named in the reply as hosted tools are."""


NamespacedTool = Annotated[
    Annotated[FunctionTool, Tag("@function")] | Annotated[CustomTool, Tag("@custom")],
    Discriminator(
        lambda v: {"function": "@function", "custom": "@custom"}.get(_kind(v)),
        custom_error_type="invalid_value",
        custom_error_message="a namespace's tool type must be 'function' or 'custom'",
    ),
]


class NamespaceTool(StrictModel):
    """Functions grouped under a name (Codex sends its sub-agent tools so). The model sees each as
    `<namespace>__<name>`, as vLLM shows them; a call comes back as `name` plus `namespace`."""

    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[NamespacedTool]


class HostedTool(_Open):
    """A tool type of HOSTED_TOOL_TYPES."""


def _tool_tag(value: Any) -> str | None:
    kind = _kind(value)
    if kind in ("function", "namespace"):
        return f"@{kind}"
    return "@hosted" if kind in HOSTED_TOOL_TYPES else None


Tool = Annotated[
    Annotated[FunctionTool, Tag("@function")]
    | Annotated[NamespaceTool, Tag("@namespace")]
    | Annotated[HostedTool, Tag("@hosted")],
    Discriminator(
        _tool_tag,
        custom_error_type="invalid_value",
        custom_error_message="tool type must be 'function', 'namespace' or one of OpenAI's hosted tool types",
    ),
]


# ---------------------------------------------------------------- tool_choice


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class AllowedToolsChoice(StrictModel):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]] = Field(min_length=1)


class HostedChoice(_Open):
    """Forces a hosted tool (`{"type": "web_search_preview"}`, `{"type": "mcp", ...}`, ...): refused."""


def _choice_tag(value: Any) -> str:
    if isinstance(value, str):
        return "@mode"
    kind = _kind(value)
    return {"function": "@function", "allowed_tools": "@allowed_tools"}.get(kind or "", "@hosted")


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("@mode")]
    | Annotated[FunctionChoice, Tag("@function")]
    | Annotated[AllowedToolsChoice, Tag("@allowed_tools")]
    | Annotated[HostedChoice, Tag("@hosted")],
    Discriminator(_choice_tag),
]


# ---------------------------------------------------------------- text.format, reasoning


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("@text")]
    | Annotated[TextFormatJsonObject, Tag("@json_object")]
    | Annotated[TextFormatJsonSchema, Tag("@json_schema")],
    Discriminator(
        lambda v: {"text": "@text", "json_object": "@json_object", "json_schema": "@json_schema"}.get(
            _kind(v)
        ),
        custom_error_type="invalid_value",
        custom_error_message="format type must be 'text', 'json_object' or 'json_schema'",
    ),
]


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a small model has one voice


class Reasoning(StrictModel):
    """Accepted: the runner's models do not reason in a separate channel, so no reasoning items come back."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# ---------------------------------------------------------------- the request


class ResponsesRequest(StrictModel):
    """POST /v1/responses. Fields the runner cannot honour are refused by name (background, conversation,
    prompt, top_logprobs > 0, logprobs in `include`); those with nothing to act on are accepted and
    documented (reasoning, truncation, service_tier, client_metadata, ...)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    model: str | None = Field(default=None, max_length=MAX_MODEL_NAME)  # the chat request's bound
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = Field(default=False, strict=True)
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation is added
    store: bool | None = None  # default true: the response is kept for previous_response_id
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    prompt_cache_key: str | None = None
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None  # OpenAI's bounds
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = Field(default=None, ge=0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    prompt_cache_retention: str | None = None
    context_management: list[Any] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's: ids and turn metadata, not shown to the model

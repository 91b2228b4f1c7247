"""OpenAI-shaped request and response types, shared by the Runner API and the sidecar.

Field names follow OpenAI's Chat Completions JSON one for one, so a body the openai client
sends validates as `ChatRequest`, and `ChatResult` / `ChatChunk` dump (`to_openai()`) to what
the openai client parses. Runner extensions (`speculation`, `provider`, `fallback_from`) are
extra top-level keys, left out when unset; OpenAI clients ignore unknown keys.

Bad input raises `pydantic.ValidationError`, whose location names the field
(e.g. `messages.2.tool_call_id`).

The types live by job in this package (messages.py, tools.py, request.py, results.py); every name is
importable from `openalice_runner.types` as before.
"""

from __future__ import annotations

from openalice_runner.types.messages import (
    ChatMessage,
    FieldError,
    FinishReason,
    FunctionCall,
    FunctionName,
    Role,
    TextPart,
    ToolCall,
    TurnType,
    coerce_messages,
    new_id,
)
from openalice_runner.types.request import (
    CONVERSATION_HEADER,
    MAX_MODEL_NAME,
    ChatRequest,
    SamplingSettings,
    StreamOptions,
)
from openalice_runner.types.results import (
    AssistantMessage,
    ChatChunk,
    ChatResult,
    Choice,
    ChunkChoice,
    Delta,
    FunctionCallDelta,
    PromptTokensDetails,
    SpeculationInfo,
    ToolCallDelta,
    Usage,
)
from openalice_runner.types.tools import (
    AllowedToolChoice,
    AllowedTools,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolChoice,
    ToolDefinition,
    check_json_schema,
)

__all__ = [
    "AllowedToolChoice",
    "AllowedTools",
    "AssistantMessage",
    "CONVERSATION_HEADER",
    "ChatChunk",
    "ChatMessage",
    "ChatRequest",
    "ChatResult",
    "Choice",
    "ChunkChoice",
    "Delta",
    "FieldError",
    "FinishReason",
    "FunctionCall",
    "FunctionCallDelta",
    "FunctionDefinition",
    "FunctionName",
    "JsonSchemaFormat",
    "MAX_MODEL_NAME",
    "NamedFunction",
    "NamedToolChoice",
    "PromptTokensDetails",
    "ResponseFormat",
    "Role",
    "SamplingSettings",
    "SpeculationInfo",
    "StreamOptions",
    "TextPart",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolDefinition",
    "TurnType",
    "Usage",
    "check_json_schema",
    "coerce_messages",
    "new_id",
]

"""A chat's messages as OpenAI's Chat Completions JSON has them, and the names every type shares
(roles, finish reasons, ids, the field-naming error)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StringConstraints,
    model_validator,
)

from openalice_runner.config_files.models import StrictModel

Role = Literal["system", "developer", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]
TurnType = str  # free-form ("chat", "tool_call", "code_edit", "summarize", ...); the policy interprets it

# OpenAI's rule for function names.
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FieldError(ValueError):
    """A request-level check that knows which field is wrong (`param`, OpenAI's dotted path): a
    model validator's error has no location of its own, so the sidecar reads it from here."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- messages


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: FunctionName
    arguments: str = Field(description="JSON-encoded arguments, as OpenAI sends them")


class ToolCall(StrictModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """One message of any role. Which fields are allowed depends on the role (checked below)."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: str | None = None  # tool only

    @model_validator(mode="after")
    def _fields_fit_role(self) -> ChatMessage:
        role = self.role
        if role == "tool":
            if not self.tool_call_id:
                raise ValueError("tool_call_id is required for role 'tool'")
        elif self.tool_call_id is not None:
            raise ValueError(f"tool_call_id is only allowed for role 'tool', not {role!r}")
        if self.tool_calls is not None and role != "assistant":
            raise ValueError(f"tool_calls is only allowed for role 'assistant', not {role!r}")
        if role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("content is required for role 'assistant' without tool_calls")
        elif self.content is None:
            raise ValueError(f"content is required for role {role!r}")
        return self

    @property
    def text(self) -> str:
        """Content as one string (text parts joined); empty when there is none."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_dict(self) -> dict[str, Any]:
        """Plain OpenAI dict (what chat templates and litellm take), unset fields left out."""
        out: dict[str, Any] = {"role": self.role, "content": self.text if self.content is not None else None}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [tc.model_dump() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def coerce_messages(messages: Any) -> list[ChatMessage]:
    """Accept dicts or ChatMessage objects (what the loop has at hand)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of dicts or ChatMessage")
    return [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]

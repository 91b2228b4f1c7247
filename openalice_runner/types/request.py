"""A chat request (OpenAI's Chat Completions body) and the sampling settings it carries."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from openalice_runner.config_files.models import StrictModel
from openalice_runner.types.messages import (
    ChatMessage,
    FieldError,
)
from openalice_runner.types.tools import (
    AllowedToolChoice,
    NamedToolChoice,
    ResponseFormat,
    ToolChoice,
    ToolDefinition,
)


class SamplingSettings(StrictModel):
    """Decoding settings in OpenAI's terms (top_k is the common extension)."""

    # NaN passes no bound check with a useful message ("less than or equal to 2"): refuse it by name.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)  # OpenAI's range (a uint64)
    stop: list[str] | None = None
    max_tokens: int | None = Field(default=None, ge=1)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            if len(v) > 16:
                raise ValueError("at most 16 stop strings")
            if any(not s for s in v):
                raise ValueError("stop strings must be non-empty")
        return v


class StreamOptions(StrictModel):
    include_usage: bool = False


MAX_MODEL_NAME = 256  # characters of a request's `model`
CONVERSATION_HEADER = "x-openalice-conversation-id"  # the loop's conversation id, from client to upstream


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop", "max_tokens")


class ChatRequest(SamplingSettings):
    """A chat completion request, OpenAI's body field for field (unsupported fields refused)."""

    # Bounded: the name reaches labels, spans, logs and tables keyed by it (a 7 MB name made every
    # /metrics scrape 535 MB). Real ids are far shorter (an HF repo id is at most 96 + 1 + 96).
    model: str | None = Field(default=None, max_length=MAX_MODEL_NAME)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream: bool = Field(default=False, strict=True)  # "yes" or 1 is refused, not taken as true
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    # OpenAI's cache-locality key, kept per conversation by the caller: the runner's conversation id
    # where none is stated (server/turn_inference.py)
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    # Accepted only at their neutral values, so a client that sends them by default still works.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @model_validator(mode="after")
    def _tools_fit_choice(self) -> ChatRequest:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise FieldError("max_tokens", "max_tokens and max_completion_tokens disagree; send one")
            self.max_tokens = self.max_completion_tokens
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise FieldError("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if choice.function.name not in names:
                raise FieldError(
                    "tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools"
                )
        if isinstance(choice, AllowedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            for i, name in enumerate(choice.allowed_tools.names):
                if name not in names:
                    raise FieldError(
                        f"tool_choice.allowed_tools.tools[{i}].function.name",
                        f"allowed_tools names {name!r}, which is not in tools",
                    )
        if self.tools:
            seen: set[str] = set()
            for i, tool in enumerate(self.tools):
                if tool.function.name in seen:
                    raise FieldError(
                        f"tools[{i}].function.name", f"duplicate function name {tool.function.name!r}"
                    )
                seen.add(tool.function.name)
        return self

    @property
    def sampling(self) -> SamplingSettings:
        return SamplingSettings(**{f: getattr(self, f) for f in _SAMPLING_FIELDS})

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolChoice:
        """What the provider should do: no tools means "none"; tools without a choice mean "auto"."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

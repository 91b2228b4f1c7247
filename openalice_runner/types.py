"""OpenAI-shaped request and response types, shared by the Runner API and the sidecar.

Field names follow OpenAI's Chat Completions JSON one for one, so a body the openai client
sends validates as `ChatRequest`, and `ChatResult` / `ChatChunk` dump (`to_openai()`) to what
the openai client parses. Runner extensions (`speculation`, `provider`, `fallback_from`) are
extra top-level keys, left out when unset; OpenAI clients ignore unknown keys.

Bad input raises `pydantic.ValidationError`, whose location names the field
(e.g. `messages.2.tool_call_id`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StringConstraints,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from openalice_runner.config_files.models import StrictModel
from openalice_runner.speculation import SpeculationOutcome, with_old_keys

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


# ---------------------------------------------------------------- tools


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` itself valid against its JSON Schema meta-schema (draft 2020-12 unless `$schema`
    names another); ValueError naming the first problem."""
    import jsonschema

    from openalice_runner.schema_limits import check_refs, check_schema_limits, known_valid, remember_valid

    check_schema_limits(schema)  # before jsonschema's check, which recurses
    # An agent loop sends the same tools on every call, and the meta-schema check costs ~1 ms a tool.
    digest = known_valid(schema)
    if digest is None:
        return schema
    check_refs(schema)  # before the grammar compiler, which follows them recursively in native code
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")) from None
    remember_valid(digest)
    return schema


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_is_object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON schema of type 'object'")
        return check_json_schema(v)


class ToolDefinition(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    @property
    def name(self) -> str:
        return self.function.name


class NamedFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class AllowedTools(StrictModel):
    """Which offered tools the model may call, and whether it must call one ("required") or may
    answer instead ("auto")."""

    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]


class AllowedToolChoice(StrictModel):
    """OpenAI's `{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`: every tool is
    still offered (the prompt stays the same, so it caches), but only these may be called."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _tool_choice_form(value: Any) -> str:
    """Which form a tool_choice is, so it is validated as that form alone and its errors name that
    form's fields (the tags are member names the sidecar leaves out of an error's field path)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind == "allowed_tools":
        return "AllowedToolChoice"
    return "NamedToolChoice" if isinstance(value, (dict, BaseModel)) else "str"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("str")]
    | Annotated[NamedToolChoice, Tag("NamedToolChoice")]
    | Annotated[AllowedToolChoice, Tag("AllowedToolChoice")],
    Discriminator(_tool_choice_form),
]


# ---------------------------------------------------------------- response_format


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: the reply is one JSON value of `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    # `schema` shadows a BaseModel attribute: stored as schema_, read and written as "schema"
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _valid_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_json_schema(v)


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: "text" (free), "json_object" (any JSON object) or "json_schema"
    (one JSON value of `json_schema.schema`). Another type is refused, naming response_format.type."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_fits_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type 'json_schema', not {self.type!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's JSON (the schema under "schema")."""
        return self.model_dump(by_alias=True, exclude_none=True)


# ---------------------------------------------------------------- request


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


# ---------------------------------------------------------------- results


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the KV cache instead of being prefilled


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # as OpenAI; None where unknown

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens),
        )


class SpeculationInfo(BaseModel):
    """What speculative decoding did for one request (runner extension to OpenAI's body): the
    JSON face of a `SpeculationOutcome`."""

    method: str = "off"  # off | ngram | draft | eagle | suffix
    gamma: int = 0  # draft tokens per round (SGLang: num_draft_tokens - 1)
    proposed: int | None = None  # draft tokens proposed
    accepted: int | None = None  # draft tokens accepted
    forced: int | None = None  # tokens a grammar forced, drafted for free (not in proposed)
    closing: int | None = None  # of the reply, tokens forced to close its structure within max_tokens
    acceptance_rate: float | None = None  # accepted / proposed
    target_passes: int | None = None  # target forward passes (decode or verify) after prefill
    tokens_per_pass: float | None = None  # completion tokens / target passes
    rule: str | None = None  # policy rule that decided
    policy_version: str | None = None
    pool: str | None = None  # SGLang pool that served
    # The policy's main input and where it came from (the server sets them): the turn type, and
    # whether it and the conversation were stated (X-OpenAlice-* headers, metadata) or inferred
    # from the request's shape and session keys (server/turn_inference.py).
    turn_type: str | None = None
    turn_type_source: str | None = None
    conversation_source: str | None = None
    # where the time before the first token went, ms by part (first_token.py FirstTokenBreakdown.as_json)
    first_token: dict[str, Any] | None = None

    @classmethod
    def from_outcome(cls, outcome: SpeculationOutcome) -> SpeculationInfo:
        return cls(
            method=outcome.method,
            gamma=outcome.gamma,
            proposed=outcome.proposed,
            accepted=outcome.accepted,
            forced=outcome.forced,
            acceptance_rate=outcome.acceptance_rate,
            target_passes=outcome.target_passes,
            tokens_per_pass=outcome.tokens_per_pass,
            rule=outcome.rule,
            policy_version=outcome.policy_version,
            pool=outcome.pool,
            first_token=None if outcome.first_token is None else outcome.first_token.as_json(),
        )

    @model_serializer(mode="wrap")
    def _with_old_keys(self, handler: SerializerFunctionWrapHandler):  # no return type: the schema stays the fields'
        # the renamed keys also under their old names for one release (speculation.OLD_KEYS)
        return with_old_keys("speculation", handler(self))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class _Extended(BaseModel):
    """Shared by result and chunk: runner extensions are left out of the JSON when unset."""

    speculation: SpeculationInfo | None = None
    provider: str | None = None  # name of the provider that served
    fallback_from: list[str] | None = None  # providers that failed before this one served
    # The stop string that ended the reply where the provider says (not part of OpenAI's JSON, which
    # has no field for it; Anthropic's stop_sequence). None: no stop string, or not known.
    _stop: str | None = PrivateAttr(default=None)

    @property
    def stop_sequence(self) -> str | None:
        return self._stop

    def with_stop(self, stop: str | None) -> Any:
        self._stop = stop
        return self

    # The max_tokens the reply ran under where the provider knows it: the caller's, clamped to what
    # the model's context leaves after the prompt (not part of the JSON; the server's
    # x-openalice-max-tokens header). None: unknown (a remote provider applies its own).
    _budget: int | None = PrivateAttr(default=None)

    @property
    def budget(self) -> int | None:
        return self._budget

    def with_budget(self, budget: int | None) -> Self:
        self._budget = budget
        return self

    def to_openai(self) -> dict[str, Any]:
        data = self.model_dump(exclude={"speculation", "provider", "fallback_from"})
        for key in ("speculation", "provider", "fallback_from"):
            value = getattr(self, key)
            if value is not None:
                data[key] = value.model_dump() if isinstance(value, BaseModel) else value
        return data


class ChatResult(_Extended):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    # None: unknown (a remote server that sent no usage), never zeros; OpenAI's `usage` is Optional too
    usage: Usage | None = None
    # What speculation did, typed, for the policy's `observe` and tracing (not part of the JSON).
    _outcome: SpeculationOutcome | None = PrivateAttr(default=None)

    @classmethod
    def single(
        cls,
        *,
        model: str,
        content: str | None,
        tool_calls: list[ToolCall] | None = None,
        finish_reason: FinishReason = "stop",
        usage: Usage | None = None,
        speculation: SpeculationInfo | None = None,
        provider: str | None = None,
        id: str | None = None,
    ) -> ChatResult:
        message = AssistantMessage(content=content, tool_calls=tool_calls or None)
        kwargs: dict[str, Any] = {}
        if id:
            kwargs["id"] = id
        return cls(
            model=model,
            choices=[Choice(message=message, finish_reason=finish_reason)],
            usage=usage,
            speculation=speculation,
            provider=provider,
            **kwargs,
        )

    @property
    def message(self) -> AssistantMessage:
        return self.choices[0].message

    @property
    def finish_reason(self) -> FinishReason:
        return self.choices[0].finish_reason

    @property
    def content(self) -> str | None:
        return self.message.content

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.message.tool_calls or []

    @property
    def outcome(self) -> SpeculationOutcome | None:
        return self._outcome

    def attach_outcome(self, outcome: SpeculationOutcome) -> ChatResult:
        self._outcome = outcome
        return self

    def as_message(self) -> ChatMessage:
        """The assistant message to append to the conversation for the next call."""
        return ChatMessage(role="assistant", content=self.message.content, tool_calls=self.message.tool_calls)


# ---------------------------------------------------------------- stream chunks


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta = Field(default_factory=Delta)
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatChunk(_Extended):
    """One streamed piece. The last chunk carries finish_reason, usage and speculation."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    _outcome: SpeculationOutcome | None = PrivateAttr(default=None)

    @classmethod
    def text(cls, id: str, model: str, text: str, role: bool = False) -> ChatChunk:
        return cls.piece(id, model, content=text, first=role)

    @classmethod
    def piece(
        cls,
        id: str,
        model: str,
        content: str | None = None,
        tool_calls: list[ToolCallDelta] | None = None,
        first: bool = False,
    ) -> ChatChunk:
        """A content and/or tool-call delta; the stream's first one carries the assistant role."""
        delta = Delta(role="assistant" if first else None, content=content, tool_calls=tool_calls or None)
        return cls(id=id, model=model, choices=[ChunkChoice(delta=delta)])

    def to_openai(self) -> dict[str, Any]:
        data = super().to_openai()
        for choice in data["choices"]:
            calls = choice["delta"].get("tool_calls")
            if calls:  # as OpenAI: a call's later pieces leave out what they lack (the openai SDK would take a null `type`)
                choice["delta"]["tool_calls"] = [_set_fields(call) for call in calls]
        return data

    @property
    def delta(self) -> Delta:
        """The first choice's delta (an empty one for a usage-only chunk)."""
        return self.choices[0].delta if self.choices else Delta()

    @property
    def delta_text(self) -> str:
        return "".join(c.delta.content or "" for c in self.choices)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.choices[0].finish_reason if self.choices else None

    @property
    def tool_call_deltas(self) -> list[ToolCallDelta]:
        return [tc for c in self.choices for tc in (c.delta.tool_calls or [])]

    @property
    def outcome(self) -> SpeculationOutcome | None:
        return self._outcome

    def attach_outcome(self, outcome: SpeculationOutcome) -> ChatChunk:
        self._outcome = outcome
        return self


def _set_fields(value: dict[str, Any]) -> dict[str, Any]:
    return {k: _set_fields(v) if isinstance(v, dict) else v for k, v in value.items() if v is not None}


def coerce_messages(messages: Any) -> list[ChatMessage]:
    """Accept dicts or ChatMessage objects (what the loop has at hand)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of dicts or ChatMessage")
    return [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]


__all__ = [
    "AllowedToolChoice",
    "AllowedTools",
    "AssistantMessage",
    "ChatChunk",
    "ChatMessage",
    "ChatRequest",
    "ChatResult",
    "Choice",
    "ChunkChoice",
    "Delta",
    "FinishReason",
    "FunctionCall",
    "FunctionCallDelta",
    "FunctionDefinition",
    "NamedToolChoice",
    "SamplingSettings",
    "SpeculationInfo",
    "StreamOptions",
    "TextPart",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolDefinition",
    "Usage",
    "coerce_messages",
    "new_id",
]

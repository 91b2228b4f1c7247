"""What a call returns: the result, its stream's chunks, usage and the speculation block."""

from __future__ import annotations

import time
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from openalice_runner.speculation import SpeculationOutcome, with_old_keys
from openalice_runner.types.messages import (
    ChatMessage,
    FinishReason,
    ToolCall,
    new_id,
)


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

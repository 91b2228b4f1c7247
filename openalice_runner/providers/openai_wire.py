"""The OpenAI chat-completions wire, shared by the providers that speak it (SGLang over HTTP, hosted
APIs through litellm): the request body, typed readers for responses and stream chunks, the
chunk accumulator, the finish-reason mapping and Retry-After.

The readers are tolerant of what upstream adds and strict about what the runner needs: unknown
fields are ignored (servers add extensions: SGLang's `matched_stop`, `meta_info`, `sglext`,
`reasoning_content`, a tool call's `index`), while a missing or mistyped field that the runner
needs (choices, a message, a finish reason, a tool call's id, function name and arguments) is a
`ProviderBadResponse`, which falls back before the first token like a 5xx and breaks the stream
(`StreamBroken`) after it; nothing missing is filled in with a default.
Shapes follow SGLang 0.5.23 `sglang/srt/entrypoints/openai/protocol.py` (ChatCompletionResponse,
ChatCompletionStreamResponse, ToolCall with `index` and `arguments: str | dict`) and OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openalice_runner.providers.base import ProviderBadResponse, StreamBroken
from openalice_runner.types import (
    ChatChunk,
    ChatRequest,
    ChunkChoice,
    FinishReason,
    FunctionCall,
    FunctionCallDelta,
    SpeculationInfo,
    ToolCall,
    ToolCallDelta,
    Usage,
    new_id,
)

# Request fields copied as they are when set. `response_format` is listed so that it passes
# through as soon as ChatRequest carries it (getattr: absent fields are skipped).
_PASS_THROUGH = (
    "temperature",
    "top_p",
    "seed",
    "stop",
    "max_tokens",
    "parallel_tool_calls",
    "response_format",
)


def request_body(request: ChatRequest, model: str, *, top_k: bool = True) -> dict[str, Any]:
    """The OpenAI chat-completions body for one request (no stream settings: callers add theirs)."""
    body: dict[str, Any] = {"model": model, "messages": request.message_dicts()}
    if request.tools:
        body["tools"] = request.tool_dicts()
    if request.tool_choice is not None:
        body["tool_choice"] = _plain(request.tool_choice)
    for field in _PASS_THROUGH + (("top_k",) if top_k else ()):
        value = getattr(request, field, None)
        if value is not None:
            body[field] = _plain(value)
    return body


def _plain(value: Any) -> Any:
    return value.model_dump(exclude_none=True, by_alias=True) if isinstance(value, BaseModel) else value


_OPENAI_FINISH: dict[str, FinishReason] = {  # the reasons OpenAI has, each as itself
    "stop": "stop", "length": "length", "tool_calls": "tool_calls", "content_filter": "content_filter"
}


def finish_reason(raw: str | None, saw_tool_calls: bool, provider: str | None = None) -> FinishReason:
    """Upstream finish reason -> OpenAI's. A natural stop that produced tool calls is `tool_calls`
    (as SGLang and OpenAI report it; `function_call` is OpenAI's deprecated name for it). Anything
    else is a bad response naming it: vLLM 0.32's `error` (a failed request it should have turned
    into a 500), `abort` (the pools answer it as unavailable first), `repetition` (a detector the
    runner never turns on) or a value no contract has would otherwise read as a clean end. None (a
    reply that never said why it ended) is a bad response too, never read as a stop."""
    if not raw:
        raise ProviderBadResponse("malformed response: finish_reason missing", provider=provider)
    if saw_tool_calls and raw in ("stop", "tool_calls", "function_call"):
        return "tool_calls"
    if raw not in _OPENAI_FINISH:
        raise ProviderBadResponse(
            f"malformed response: finish_reason {raw[:40]!r} is not one of OpenAI's ({', '.join(_OPENAI_FINISH)})",
            provider=provider,
        )
    return _OPENAI_FINISH[raw]


def retry_after(headers: Mapping[str, Any] | None) -> float | None:
    """Seconds from a Retry-After header (seconds form), None when absent or unreadable."""
    if not headers:
        return None
    try:
        value = headers.get("retry-after") or headers.get("Retry-After")
        return float(value) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------- wire shapes (read side)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class WireFunction(_Wire):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None  # SGLang's FunctionResponse allows a dict

    def arguments_text(self) -> str | None:
        if isinstance(self.arguments, dict):
            return json.dumps(self.arguments, ensure_ascii=False)
        return self.arguments


class WireToolCall(_Wire):
    id: str | None = None
    index: int | None = None
    type: str | None = None
    function: WireFunction


class WireMessage(_Wire):
    content: str | None = None
    tool_calls: list[WireToolCall] | None = None


class WirePromptDetails(_Wire):
    cached_tokens: int | None = None  # vLLM sends it with --enable-prompt-tokens-details


class WireUsage(_Wire):
    """OpenAI's `usage` (absent or null where a server has none: both are Optional in OpenAI's
    ChatCompletion and chunk). A count the server left out is unknown, never 0."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: WirePromptDetails | None = None

    def usage(self) -> Usage | None:
        """The counts, or None (unknown) where either is missing."""
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        details = self.prompt_tokens_details
        return Usage.of(self.prompt_tokens, self.completion_tokens, details.cached_tokens if details else None)


def usage_of(usage: WireUsage | None) -> Usage | None:
    """A reply's usage: None (unknown) where the server sent none."""
    return usage.usage() if usage is not None else None


class WireSpecDetails(_Wire):
    """SGLang 0.5.23 `SpecTokensDetails` (protocol.py), read under the names 0.5.23 sends
    (tokenizer_manager.py `_calculate_spec_decoding_metrics`)."""

    spec_accept_rate: float = 0.0
    spec_accept_length: float = 0.0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    spec_verify_ct: int = 0
    spec_correct_drafts_histogram: list[int] = Field(default_factory=list)


class WireSglExt(_Wire):
    spec_tokens_details: WireSpecDetails | list[WireSpecDetails] | None = None

    def spec(self) -> WireSpecDetails | None:
        details = self.spec_tokens_details
        if isinstance(details, list):  # one per choice when n > 1; the runner asks for n = 1
            return details[0] if details else None
        return details


class WireChoice(_Wire):
    message: WireMessage
    finish_reason: str  # required: a finished reply says why it ended (OpenAI, SGLang and vLLM send it)
    meta_info: dict[str, Any] | None = None


class WireResponse(_Wire):
    id: str | None = None
    model: str | None = None
    choices: list[WireChoice] = Field(min_length=1)
    usage: WireUsage | None = None
    sglext: WireSglExt | None = None


class WireDelta(_Wire):
    content: str | None = None
    tool_calls: list[WireToolCall] | None = None


class WireStreamChoice(_Wire):
    index: int = 0
    delta: WireDelta = Field(default_factory=WireDelta)
    finish_reason: str | None = None


class WireChunk(_Wire):
    id: str | None = None
    model: str | None = None
    choices: list[WireStreamChoice] = Field(default_factory=list)
    usage: WireUsage | None = None
    sglext: WireSglExt | None = None


def read_response(data: Any, provider: str) -> WireResponse:
    return _read(WireResponse, data, provider, "response")


def read_chunk(data: Any, provider: str) -> WireChunk:
    return _read(WireChunk, data, provider, "stream chunk")


def _read(model: type[_Wire], data: Any, provider: str, what: str) -> Any:
    if isinstance(data, BaseModel):  # litellm's response objects
        data = data.model_dump()
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ProviderBadResponse(
            f"malformed {what} from upstream: {where}: {first['msg']}", provider=provider
        ) from None


def tool_calls_of(message: WireMessage, provider: str, finish: str | None = None) -> list[ToolCall] | None:
    """A finished message's tool calls in the runner's shape; a call without its id, function name
    or arguments is malformed (the runner would have to invent them). Where the budget ended the
    reply (`finish` "length") a call may stop before its arguments began: its arguments so far, "".

    Arguments are passed on as the model wrote them, valid JSON or not (OpenAI's contract: "the
    model does not always generate valid JSON"; the agent checks them). Empty ones are not
    arguments at all: OpenAI sends "{}" for a function without parameters, and vLLM 0.32's and
    SGLang 0.5.23's parsers `json.dumps` what they parsed ("{}" again), so "" on a call the budget
    did not cut means the server lost them; it is a bad response naming the field.
    """
    out: list[ToolCall] = []
    cut = finish == "length"
    for i, tc in enumerate(message.tool_calls or ()):
        missing = _missing(tc)
        if missing and not (cut and missing == "function.arguments"):
            raise ProviderBadResponse(f"malformed response: tool_calls.{i}.{missing} missing or empty",
                                      provider=provider)  # fmt: skip
        try:
            call = ToolCall(
                id=tc.id, function=FunctionCall(name=tc.function.name, arguments=tc.function.arguments_text() or "")
            )
        except ValidationError as exc:
            raise ProviderBadResponse(
                f"malformed response: tool_calls.{i}: {exc.errors(include_url=False)[0]['msg']}",
                provider=provider,
            ) from None
        out.append(call)
    return out or None


def _missing(tc: WireToolCall) -> str | None:
    """The first of a finished tool call's required fields that it lacks, else None."""
    if not tc.id:
        return "id"
    if not tc.function.name:
        return "function.name"
    if not _has_arguments(tc.function.arguments_text()):
        return "function.arguments"
    return None


def _has_arguments(text: str | None) -> bool:
    return bool(text and text.strip())


def tool_call_delta(tc: WireToolCall, position: int) -> ToolCallDelta:
    """A streamed tool-call piece. SGLang and OpenAI send `index` (the call's ordinal); without it
    the piece's position in its chunk stands in."""
    return ToolCallDelta(
        index=tc.index if tc.index is not None else position,
        id=tc.id,
        type="function" if tc.id else None,
        function=FunctionCallDelta(name=tc.function.name, arguments=tc.function.arguments_text()),
    )


# ---------------------------------------------------------------- stream accumulation


class ChunkAccumulator:
    """Reads a stream's chunks in order: yields runner chunks for content and tool-call deltas and
    remembers what the final chunk needs (id, model, finish reason, usage, SGLang's sglext).

    A tool call's first piece must carry its id and name, and some piece its arguments (unless the
    budget ended the reply first); a stream that ends without a finish reason, or with a call
    lacking one of these, is a bad response
    (`ProviderBadResponse` before the first chunk went out, `StreamBroken` after): nothing is invented."""

    def __init__(self, model: str, provider: str | None = None) -> None:
        self.id = new_id("chatcmpl")
        self.model = model
        self.provider = provider
        self.calls: dict[int, bool] = {}  # tool call index -> whether any piece carried arguments
        self.finish: str | None = None
        self.usage: Usage | None = None
        self.sglext: WireSglExt | None = None
        self.started = False
        self.saw_tool_calls = False

    def feed(self, chunk: WireChunk) -> list[ChatChunk]:
        self.id = chunk.id or self.id
        self.model = chunk.model or self.model
        usage = usage_of(chunk.usage)  # vLLM and SGLang send it on the last chunk only (null before)
        if usage is not None:
            self.usage = usage
        if chunk.sglext is not None:
            self.sglext = chunk.sglext
        out: list[ChatChunk] = []
        for choice in chunk.choices:
            if choice.finish_reason:
                self.finish = choice.finish_reason
            content, calls = choice.delta.content, choice.delta.tool_calls
            if not content and not calls:
                continue  # role-only opener or finish marker: not a token
            self.saw_tool_calls = self.saw_tool_calls or bool(calls)
            deltas = [tool_call_delta(tc, i) for i, tc in enumerate(calls)] if calls else None
            for tc, delta in zip(calls or (), deltas or (), strict=True):
                self._check_call_piece(tc, delta.index)
            out.append(ChatChunk.piece(self.id, self.model, content or None, deltas, first=not self.started))
            self.started = True
        return out

    def _check_call_piece(self, tc: WireToolCall, index: int) -> None:
        if index not in self.calls:
            for name, value in (("id", tc.id), ("function.name", tc.function.name)):
                if not value:
                    raise ProviderBadResponse(f"malformed stream: tool call {index}'s first piece has no {name}",
                                              provider=self.provider)  # fmt: skip
            self.calls[index] = False
        self.calls[index] = self.calls[index] or _has_arguments(tc.function.arguments_text())

    def final(self, speculation: SpeculationInfo, provider: str) -> ChatChunk:
        """The closing chunk: finish reason, usage (None where the server sent none: unknown),
        speculation."""
        problem = None
        finish: FinishReason | None = None
        if self.finish is None:
            problem = "the stream ended without a finish_reason"
        elif self.finish != "length" and not all(self.calls.values()):
            # a call the budget cut before its arguments began is what it is: vLLM 0.32 sends the
            # name, then finish "length", for a forced call whose envelope the budget ends
            i = min(i for i, seen in self.calls.items() if not seen)
            problem = f"tool call {i} never got its arguments (tool_calls.{i}.function.arguments empty)"
        else:
            try:
                finish = finish_reason(self.finish, self.saw_tool_calls, provider)
            except ProviderBadResponse as exc:
                problem = exc.message.removeprefix("malformed response: ")
        if problem is not None or finish is None:
            error = StreamBroken if self.started else ProviderBadResponse
            raise error(f"malformed stream: {problem}", provider=provider)
        return ChatChunk(
            id=self.id,
            model=self.model,
            choices=[ChunkChoice(finish_reason=finish)],
            usage=self.usage,
            speculation=speculation,
            provider=provider,
        )

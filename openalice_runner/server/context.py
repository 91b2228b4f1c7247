"""A request's turn context: from X-OpenAlice-* headers, else the body's `metadata` (`stated`), else
what the request's shape and session keys say (`inferred`, server/turn_inference.py); plus the
caller's W3C `traceparent`, which the request's spans continue."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from openalice_runner.server.disclosure import SpeculationInfoLevel, disclosed
from openalice_runner.server.errors import APIError
from openalice_runner.server.turn_inference import INFERRED, STATED, infer_turn_type, inferred_conversation
from openalice_runner.tracing import attributes as A
from openalice_runner.types import CONVERSATION_HEADER, ChatChunk, ChatRequest, ChatResult

HEADER_TURN_TYPE = "x-openalice-turn-type"
HEADER_STEP = "x-openalice-step"
HEADER_AGENT = "x-openalice-agent"
_MAX_ID = 256
_propagator = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TurnContext:
    conversation_id: str | None
    turn_type: str
    step: int | None
    agent: str | None
    turn_type_source: str = STATED  # stated | inferred | default (no request to infer from)
    conversation_source: str | None = None  # stated | inferred; None: no conversation
    turn_type_row: str | None = None  # the inference table's row that decided (turn_inference.py)
    conversation_key: str | None = None  # an inferred conversation's key (prompt_cache_key, a session header)


def _text(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > _MAX_ID or not value.isprintable():
        raise APIError(400, f"{name} must be printable and at most {_MAX_ID} characters", param=name)
    return value


def _inferred_id(value: str | None) -> str | None:
    """A session key as a conversation id; one that could not be an id is no conversation, not a
    400: the caller did not send it for us."""
    value = (value or "").strip()
    return value if value and len(value) <= _MAX_ID and value.isprintable() else None


def _body_key(request: ChatRequest) -> str:
    return "prompt_cache_key" if request.prompt_cache_key else "user"


def turn_context(
    headers: Mapping[str, str],
    metadata: Mapping[str, str] | None,
    request: ChatRequest | None = None,
    *,
    session: str | None = None,
    session_key: str | None = None,
) -> TurnContext:
    """Headers win over metadata keys conversation_id, turn_type, step, agent; what neither states
    is inferred: the conversation from `session` (a wire's own session key, e.g. Claude Code's
    session id; `session_key` names it), else `request`'s prompt_cache_key / user; the turn type
    from `request`'s shape."""
    meta = metadata or {}
    conversation = _text(headers.get(CONVERSATION_HEADER) or meta.get("conversation_id"), "conversation_id")
    conversation_source = STATED if conversation else None
    key = None
    if conversation is None:
        conversation, key = _inferred_id(session), session_key or "session"
        if conversation is None and request is not None:
            conversation, key = _inferred_id(inferred_conversation(request)), _body_key(request)
        conversation_source = INFERRED if conversation else None
        key = key if conversation else None
    turn_type = _text(headers.get(HEADER_TURN_TYPE) or meta.get("turn_type"), "turn_type")
    turn_type_source, row = STATED, None
    if turn_type is None and request is not None:
        inferred = infer_turn_type(request)
        turn_type, turn_type_source, row = inferred.turn_type, INFERRED, inferred.row
    elif turn_type is None:
        turn_type, turn_type_source = "chat", "default"
    agent = _text(headers.get(HEADER_AGENT) or meta.get("agent"), "agent")
    raw_step = headers.get(HEADER_STEP) or meta.get("step")
    step = None
    if raw_step is not None and str(raw_step).strip():
        try:
            step = int(str(raw_step).strip())
        except ValueError:
            raise APIError(
                400, f"step must be an integer, got {str(raw_step)[:40]!r}", param="step"
            ) from None
        if not 0 <= step <= 1_000_000:
            raise APIError(400, "step must be between 0 and 1000000", param="step")
    return TurnContext(conversation, turn_type, step, agent, turn_type_source, conversation_source, row, key)


def mark_sources(span: Any, tc: TurnContext) -> None:
    """The turn span says where its turn type and conversation came from."""
    if span.is_recording():
        attrs = {A.TURN_TYPE_SOURCE: tc.turn_type_source}
        if tc.turn_type_row is not None:
            attrs[A.TURN_TYPE_INFERRED_BY] = tc.turn_type_row
        if tc.conversation_source is not None:
            attrs[A.CONVERSATION_SOURCE] = tc.conversation_source
        if tc.conversation_key is not None:
            attrs[A.CONVERSATION_INFERRED_FROM] = tc.conversation_key
        span.set_attributes(attrs)


Reply = TypeVar("Reply", ChatResult, ChatChunk)


def with_sources(reply: Reply, tc: TurnContext, level: SpeculationInfoLevel = "full") -> Reply:
    """The reply's `speculation` (where it has one) says the turn type and where it and the
    conversation came from, and shows what `level` lets its caller see (server/disclosure.py)."""
    info = reply.speculation
    if info is not None:
        info.turn_type, info.turn_type_source, info.conversation_source = (
            tc.turn_type, tc.turn_type_source, tc.conversation_source)
        reply.speculation = disclosed(info, level)
    return reply


async def stamped(
    chunks: AsyncIterator[ChatChunk], tc: TurnContext, level: SpeculationInfoLevel = "full"
) -> AsyncIterator[ChatChunk]:
    """A stream's chunks through `with_sources` (the last one carries speculation)."""
    async for chunk in chunks:
        yield with_sources(chunk, tc, level)


def caller_trace_context(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The caller's span context from `traceparent` (malformed ones are ignored, as W3C says)."""
    if "traceparent" not in headers:
        return None
    ctx = _propagator.extract(carrier={k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
    from opentelemetry import trace

    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

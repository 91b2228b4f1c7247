"""A request's turn context: from X-OpenAlice-* headers, else the body's `metadata`; plus the caller's
W3C `traceparent`, which the request's spans continue."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from openalice_runner.server.errors import APIError
from openalice_runner.types import CONVERSATION_HEADER

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


def _text(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > _MAX_ID or not value.isprintable():
        raise APIError(400, f"{name} must be printable and at most {_MAX_ID} characters", param=name)
    return value


def turn_context(headers: Mapping[str, str], metadata: Mapping[str, str] | None) -> TurnContext:
    """Headers win over metadata keys conversation_id, turn_type, step, agent."""
    meta = metadata or {}
    conversation = _text(headers.get(CONVERSATION_HEADER) or meta.get("conversation_id"), "conversation_id")
    turn_type = _text(headers.get(HEADER_TURN_TYPE) or meta.get("turn_type"), "turn_type") or "chat"
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
    return TurnContext(conversation, turn_type, step, agent)


def caller_trace_context(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The caller's span context from `traceparent` (malformed ones are ignored, as W3C says)."""
    if "traceparent" not in headers:
        return None
    ctx = _propagator.extract(carrier={k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
    from opentelemetry import trace

    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None

"""Agent turns as the sidecar sees them: a run of requests of one conversation.

A loop in another process runs its turn as several requests: model call, its tools, model call, ...
until an answer without tool calls. The tracker keeps one `invoke_agent` span open per conversation
across those requests, so the trace shows the turn whole:
- a request with a conversation id and no open turn starts one (child of the caller's `traceparent`);
- a response that asks for tools keeps the turn open; the next request that brings their results
  closes the gap as `execute_tool` spans, timed from the response to the request;
- a response without tool calls, an error, a new trace or user message, idleness or shutdown ends it.
Without a conversation id each request is a turn of its own.
Open turns are bounded (oldest evicted first) and reaped when idle, so no client can grow them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span

from openalice_runner.providers.base import scoped_conversation
from openalice_runner.tracing import attributes as A
from openalice_runner.tracing.telemetry import RunnerTelemetry


@dataclass
class OpenTurn:
    span: Span
    conversation_id: str | None
    turn_type: str
    trace_id: int
    steps: int = 0  # steps so far: model calls and tool calls, numbered 1, 2, ... as the Runner does
    pending_tools: dict[str, str] = field(default_factory=dict)  # call id -> tool name
    pending_since_ns: int = 0  # when the response asking for those tools went out
    last_active: float = field(default_factory=time.monotonic)
    busy: bool = False  # a request of this turn is running
    ended: bool = False
    key: str | None = None  # where the tracker keeps it: the conversation id scoped by its tenant

    @property
    def context(self) -> otel_context.Context:
        return trace.set_span_in_context(self.span)


@dataclass
class Step:
    """One request's place in its turn."""

    turn: OpenTurn
    step: int
    tracked: bool  # kept by the tracker (has a conversation id) or a one-request turn


def _tool_results(messages: Sequence[Any]) -> list[str]:
    """tool_call_ids answered by the trailing tool messages of a request."""
    ids: list[str] = []
    for message in reversed(messages):
        if getattr(message, "role", None) != "tool":
            break
        ids.append(message.tool_call_id)
    return list(reversed(ids))


class TurnTracker:
    def __init__(
        self, telemetry: RunnerTelemetry, *, max_open: int = 4096, idle_timeout_s: float = 300.0
    ) -> None:
        self.telemetry = telemetry
        self.max_open = max_open
        self.idle_timeout_s = idle_timeout_s
        self._open: OrderedDict[str, OpenTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def begin(
        self,
        *,
        conversation_id: str | None,
        turn_type: str,
        agent: str | None,
        parent: otel_context.Context | None,
        messages: Sequence[Any],
        step: int | None = None,
        tenant: str | None = None,
    ) -> Step:
        """Place a request in its turn (starting one if needed) and record the tool steps it answers.
        The same conversation id from two tenants names two conversations."""
        now_ns = time.time_ns()
        parent_trace = trace.get_current_span(parent).get_span_context() if parent is not None else None
        key = scoped_conversation(tenant, conversation_id)  # where the tracker keeps the turn; None: one request
        turn = self._open.get(key) if key else None
        if turn is not None and turn.busy:
            # A second request of the conversation while one runs: traced as a turn of its own.
            turn, key = None, None
        if key and turn is not None:
            answered = _tool_results(messages)
            same_trace = (
                parent_trace is None or not parent_trace.is_valid or parent_trace.trace_id == turn.trace_id
            )
            continues = same_trace and answered and all(i in turn.pending_tools for i in answered)
            if not continues:
                self._end(key, end_reason="superseded")
                turn = None
            else:
                for call_id in answered:
                    turn.steps += 1
                    self.telemetry.record_tool_call(
                        turn.pending_tools[call_id],
                        call_id,
                        start_time_ns=turn.pending_since_ns,
                        end_time_ns=now_ns,
                        step=turn.steps,
                        turn_type=turn.turn_type,
                        parent=turn.context,
                    )
                turn.pending_tools.clear()
                self._open.move_to_end(key)
        if turn is None:
            span = self.telemetry.start_turn(
                agent, conversation_id, turn_type, parent=parent, start_time_ns=now_ns
            )
            if tenant is not None:
                span.set_attribute(A.TENANT, tenant)
            turn = OpenTurn(span, conversation_id, turn_type, span.get_span_context().trace_id, key=key)
            if key is not None:
                self._open[key] = turn
                self._evict()
        turn.busy = True
        turn.last_active = time.monotonic()
        turn.steps += 1
        number = step if step is not None else turn.steps
        return Step(turn, number, tracked=key is not None)

    def finish(
        self,
        step: Step,
        *,
        finish_reason: str | None = None,
        tool_calls: Sequence[tuple[str, str]] = (),
        error: BaseException | None = None,
    ) -> None:
        """The request's response is out. `tool_calls`: (call id, tool name) it asked for."""
        turn = step.turn
        turn.busy = False
        turn.last_active = time.monotonic()
        if error is None and finish_reason == "tool_calls" and tool_calls and step.tracked:
            turn.pending_tools = dict(tool_calls)
            turn.pending_since_ns = time.time_ns()
            return
        key = turn.key
        if step.tracked and key is not None and self._open.get(key) is turn:
            del self._open[key]
        reason = (
            "error"
            if error is not None
            else ("final_answer" if finish_reason != "tool_calls" else "tool_calls")
        )
        self._end_span(turn, error=error, end_reason=reason)

    def reap_idle(self) -> int:
        """End turns idle for longer than idle_timeout_s (a loop that never came back)."""
        cutoff = time.monotonic() - self.idle_timeout_s
        stale = [cid for cid, t in self._open.items() if not t.busy and t.last_active < cutoff]
        for cid in stale:
            self._end(cid, end_reason="idle")
        return len(stale)

    def close_all(self, end_reason: str = "shutdown") -> None:
        for cid in list(self._open):
            self._end(cid, end_reason=end_reason)

    def _evict(self) -> None:
        while len(self._open) > self.max_open:
            cid = next(iter(self._open))
            self._end(cid, end_reason="evicted")

    def _end(self, conversation_id: str, *, end_reason: str) -> None:
        turn = self._open.pop(conversation_id, None)
        if turn is not None:
            self._end_span(turn, end_reason=end_reason)

    def _end_span(self, turn: OpenTurn, *, end_reason: str, error: BaseException | None = None) -> None:
        if not turn.ended:
            turn.ended = True
            self.telemetry.end_turn(turn.span, error=error, steps=turn.steps, end_reason=end_reason)

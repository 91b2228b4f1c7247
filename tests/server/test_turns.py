"""TurnTracker: how the sidecar groups requests into agent turns, and keeps that bounded."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from openalice_runner.server.turns import TurnTracker
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.types import ChatMessage


def _tracker(**kw):
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return TurnTracker(RunnerTelemetry(provider), **kw), spans


USER = [ChatMessage(role="user", content="hi")]


def _tool_reply(*call_ids: str) -> list[ChatMessage]:
    return [*USER, *(ChatMessage(role="tool", tool_call_id=c, content="ok") for c in call_ids)]


def _begin(tracker, conversation="c1", messages=USER, **kw):
    return tracker.begin(
        conversation_id=conversation, turn_type="tool_call", agent="a", parent=None, messages=messages, **kw
    )


def _names(spans):
    return sorted(s.name for s in spans.get_finished_spans())


def test_parallel_tool_calls_become_one_span_each_then_final_answer_ends_turn():
    tracker, spans = _tracker()
    step = _begin(tracker)
    assert step.step == 1
    tracker.finish(step, finish_reason="tool_calls", tool_calls=[("x1", "search"), ("x2", "fetch")])
    assert len(tracker) == 1 and _names(spans) == []
    step = _begin(tracker, messages=_tool_reply("x1", "x2"))
    assert step.step == 4  # chat 1, tools 2 and 3
    tracker.finish(step, finish_reason="stop")
    assert len(tracker) == 0
    assert _names(spans) == ["execute_tool fetch", "execute_tool search", "invoke_agent a"]
    [turn] = [s for s in spans.get_finished_spans() if s.name == "invoke_agent a"]
    assert turn.attributes["openalice.turn.steps"] == 4
    assert turn.attributes["openalice.turn.end_reason"] == "final_answer"


def test_a_request_that_does_not_answer_the_pending_tools_starts_a_new_turn():
    tracker, spans = _tracker()
    tracker.finish(_begin(tracker), finish_reason="tool_calls", tool_calls=[("x1", "search")])
    step = _begin(tracker, messages=USER)  # a fresh user message instead of the tool result
    ended = [s for s in spans.get_finished_spans() if s.name == "invoke_agent a"]
    assert [s.attributes["openalice.turn.end_reason"] for s in ended] == ["superseded"]
    assert step.step == 1
    tracker.finish(step, finish_reason="stop")
    assert len(tracker) == 0


def test_concurrent_request_of_a_busy_conversation_is_its_own_turn():
    tracker, spans = _tracker()
    first = _begin(tracker)
    second = _begin(tracker)
    assert second.turn is not first.turn and not second.tracked
    tracker.finish(second, finish_reason="stop")
    tracker.finish(first, finish_reason="stop")
    assert _names(spans) == ["invoke_agent a", "invoke_agent a"]
    assert len(tracker) == 0


def test_errors_end_the_turn_with_error_status():
    tracker, spans = _tracker()
    tracker.finish(_begin(tracker), error=RuntimeError("boom"))
    [turn] = spans.get_finished_spans()
    assert turn.attributes["error.type"] == "RuntimeError"
    assert turn.attributes["openalice.turn.end_reason"] == "error"


def test_open_turns_are_bounded_and_reaped_when_idle():
    tracker, spans = _tracker(max_open=3, idle_timeout_s=0.0)
    for i in range(5):
        tracker.finish(
            _begin(tracker, conversation=f"c{i}"), finish_reason="tool_calls", tool_calls=[("x", "t")]
        )
    assert len(tracker) == 3  # the two oldest were evicted
    assert [s.attributes["openalice.turn.end_reason"] for s in spans.get_finished_spans()] == ["evicted"] * 2
    assert tracker.reap_idle() == 3 and len(tracker) == 0
    tracker.finish(_begin(tracker, conversation="z"), finish_reason="tool_calls", tool_calls=[("x", "t")])
    tracker.close_all()
    assert spans.get_finished_spans()[-1].attributes["openalice.turn.end_reason"] == "shutdown"


def test_request_without_conversation_is_a_one_request_turn():
    tracker, spans = _tracker()
    step = tracker.begin(conversation_id=None, turn_type="chat", agent=None, parent=None, messages=USER)
    tracker.finish(step, finish_reason="tool_calls", tool_calls=[("x", "t")])  # nothing to wait for
    assert len(tracker) == 0 and _names(spans) == ["invoke_agent"]

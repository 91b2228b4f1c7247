"""RunnerTelemetry: the spans and metrics of turns, model calls and tool steps.

Library code: it takes a tracer/meter provider if given and otherwise uses the global OpenTelemetry API
(a no-op until an application installs providers). It never installs anything itself.

Span tree of one agent turn:
    invoke_agent {agent}            INTERNAL  (turn_span / start_turn)
      chat {model}                  CLIENT    (start_chat, used by InstrumentedProvider)
      execute_tool {name}           INTERNAL  (tool_span / start_tool / record_tool_call)
      chat {model}                  ...

A model call's span once open, its attributes and how it ends: chat_call.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import Histogram
from opentelemetry.trace import Span, SpanKind

from openalice_runner.speculation import SpeculationOutcome, SpeculationPlan
from openalice_runner.tracing import attributes as A
from openalice_runner.tracing.chat_call import ChatCall, mark_error, plan_attributes, request_attributes
from openalice_runner.tracing.labels import LabelBounds
from openalice_runner.types import ChatRequest

SCOPE = "openalice_runner"
_NS_PER_S = 1_000_000_000


def _version() -> str:
    from openalice_runner import __version__

    return __version__


def _histogram(meter: metrics.Meter, name: str, unit: str, buckets: Sequence[float], description: str) -> Histogram:
    return meter.create_histogram(name, unit=unit, description=description,
                                  explicit_bucket_boundaries_advisory=list(buckets))


class RunnerTelemetry:
    """Spans and metrics for turns, model calls and tool steps (see module docstring)."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        record_content: bool = False,
    ) -> None:
        self.record_content = record_content
        # Client-chosen label values (turn type, model, tool name) stay bounded; the server narrows it.
        self.label_bounds = LabelBounds()
        version = _version()
        self.tracer = trace.get_tracer(SCOPE, version, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, version, meter_provider=meter_provider)
        histogram = partial(_histogram, meter)
        self._op_duration = histogram(
            A.METRIC_OPERATION_DURATION, "s", A.DURATION_BUCKETS_S, "GenAI operation duration.")
        self._token_usage = histogram(
            A.METRIC_TOKEN_USAGE, "{token}", A.TOKEN_BUCKETS, "Number of input and output tokens used.")
        self._ttfc = histogram(
            A.METRIC_TIME_TO_FIRST_CHUNK, "s", A.DURATION_BUCKETS_S,
            "Time to receive the first chunk in a streaming operation.")
        self._agent_duration = histogram(
            A.METRIC_INVOKE_AGENT_DURATION, "s", A.DURATION_BUCKETS_S, "Duration of an agent turn.")
        self._tool_duration = histogram(
            A.METRIC_EXECUTE_TOOL_DURATION, "s", A.DURATION_BUCKETS_S, "Duration of a tool execution.")
        self._accepted_drafts_per_round = histogram(
            A.METRIC_ACCEPTED_DRAFTS_PER_ROUND, "{token}", A.ACCEPTED_DRAFTS_PER_ROUND_BUCKETS,
            "Mean draft tokens accepted per verify round, one value per model call.")
        self._tokens_per_second = histogram(
            A.METRIC_TOKENS_PER_SECOND, "{token}/s", A.TOKENS_PER_SECOND_BUCKETS,
            "Output tokens per second of a model call, prefill included.")

    # ---- turns ---------------------------------------------------------------------------------
    def start_turn(
        self,
        agent: str | None = None,
        conversation_id: str | None = None,
        turn_type: str | None = None,
        *,
        parent: otel_context.Context | None = None,
        start_time_ns: int | None = None,
    ) -> Span:
        """Open an `invoke_agent` span without making it current (the server keeps turns across requests)."""
        attrs: dict[str, Any] = {A.GEN_AI_OPERATION_NAME: A.OP_INVOKE_AGENT}
        if agent:
            attrs[A.GEN_AI_AGENT_NAME] = agent
        if conversation_id:
            attrs[A.GEN_AI_CONVERSATION_ID] = conversation_id
        if turn_type:
            attrs[A.TURN_TYPE] = turn_type
        name = f"{A.OP_INVOKE_AGENT} {agent}" if agent else A.OP_INVOKE_AGENT
        return self.tracer.start_span(
            name, context=parent, kind=SpanKind.INTERNAL, attributes=attrs, start_time=start_time_ns
        )

    def end_turn(
        self,
        span: Span,
        *,
        error: BaseException | None = None,
        steps: int | None = None,
        end_reason: str | None = None,
        end_time_ns: int | None = None,
    ) -> None:
        if not span.is_recording():
            span.end(end_time=end_time_ns)
            return
        if steps is not None:
            span.set_attribute(A.TURN_STEPS, steps)
        if end_reason:
            span.set_attribute(A.TURN_END_REASON, end_reason)
        labels = {A.GEN_AI_OPERATION_NAME: A.OP_INVOKE_AGENT}
        turn_type = _span_attr(span, A.TURN_TYPE)
        if turn_type:
            labels[A.TURN_TYPE] = turn_type
        if error is not None:
            labels[A.ERROR_TYPE] = mark_error(span, error)
        end_ns = end_time_ns or time.time_ns()
        start_ns = getattr(span, "start_time", None)
        span.end(end_time=end_ns)
        if start_ns:
            self._agent_duration.record((end_ns - start_ns) / _NS_PER_S, self.label_bounds.bound(labels))

    @contextmanager
    def turn_span(
        self, agent: str | None, conversation_id: str | None = None, turn_type: str | None = None
    ) -> Iterator[Span]:
        """`invoke_agent {agent}`, current for the block: model and tool spans inside become its children."""
        span = self.start_turn(agent, conversation_id, turn_type)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield span
        except BaseException as exc:
            self.end_turn(span, error=exc)
            raise
        else:
            self.end_turn(span)
        finally:
            otel_context.detach(token)

    # ---- tools ---------------------------------------------------------------------------------
    def start_tool(
        self,
        name: str,
        call_id: str | None = None,
        step: int | None = None,
        turn_type: str | None = None,
        *,
        parent: otel_context.Context | None = None,
        start_time_ns: int | None = None,
        arguments: Any = None,
    ) -> Span:
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: A.OP_EXECUTE_TOOL,
            A.GEN_AI_TOOL_NAME: name,
            A.GEN_AI_TOOL_TYPE: "function",
        }
        if call_id:
            attrs[A.GEN_AI_TOOL_CALL_ID] = call_id
        if step is not None:
            attrs[A.STEP] = int(step)
        if turn_type:
            attrs[A.TURN_TYPE] = turn_type
        if self.record_content and arguments is not None:
            attrs[A.GEN_AI_TOOL_CALL_ARGUMENTS] = (
                arguments if isinstance(arguments, str) else json.dumps(arguments, default=str)
            )
        return self.tracer.start_span(
            f"{A.OP_EXECUTE_TOOL} {name}",
            context=parent,
            kind=SpanKind.INTERNAL,
            attributes=attrs,
            start_time=start_time_ns,
        )

    def end_tool(
        self,
        span: Span,
        *,
        error: BaseException | None = None,
        result: Any = None,
        end_time_ns: int | None = None,
    ) -> None:
        labels: dict[str, Any] = {A.GEN_AI_OPERATION_NAME: A.OP_EXECUTE_TOOL}
        if span.is_recording():
            name = _span_attr(span, A.GEN_AI_TOOL_NAME)
            if name:
                labels[A.GEN_AI_TOOL_NAME] = name
            if error is not None:
                labels[A.ERROR_TYPE] = mark_error(span, error)
            if self.record_content and result is not None:
                span.set_attribute(
                    A.GEN_AI_TOOL_CALL_RESULT,
                    result if isinstance(result, str) else json.dumps(result, default=str),
                )
        end_ns = end_time_ns or time.time_ns()
        start_ns = getattr(span, "start_time", None)
        span.end(end_time=end_ns)
        if start_ns:
            self._tool_duration.record((end_ns - start_ns) / _NS_PER_S, self.label_bounds.bound(labels))

    @contextmanager
    def tool_span(
        self,
        name: str,
        call_id: str | None = None,
        step: int | None = None,
        turn_type: str | None = None,
        *,
        arguments: Any = None,
    ) -> Iterator[Span]:
        """`execute_tool {name}` around the caller's own tool code, current for the block."""
        span = self.start_tool(name, call_id, step, turn_type, arguments=arguments)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield span
        except BaseException as exc:
            self.end_tool(span, error=exc)
            raise
        else:
            self.end_tool(span)
        finally:
            otel_context.detach(token)

    def record_tool_call(
        self,
        name: str,
        call_id: str | None,
        *,
        start_time_ns: int,
        end_time_ns: int,
        step: int | None = None,
        turn_type: str | None = None,
        parent: otel_context.Context | None = None,
        result: Any = None,
    ) -> None:
        """A tool step that ran elsewhere (the sidecar sees it as the gap between two requests)."""
        span = self.start_tool(name, call_id, step, turn_type, parent=parent, start_time_ns=start_time_ns)
        self.end_tool(span, result=result, end_time_ns=end_time_ns)

    # ---- model calls ---------------------------------------------------------------------------
    def start_chat(
        self,
        *,
        model: str | None,
        provider: str | None,
        gen_ai_provider: str | None = None,
        turn_type: str | None = None,
        conversation_id: str | None = None,
        step: int | None = None,
        agent: str | None = None,
        plan: SpeculationPlan | None = None,
        request: ChatRequest | None = None,
        stream: bool = False,
        parent: otel_context.Context | None = None,
        tenant: str | None = None,
    ) -> ChatCall:
        """Open a `chat {model}` CLIENT span for one call of a turn (`plan`: the policy's;
        `tenant`: whose key the request came with, a span attribute and a bounded metric label)."""
        attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: A.OP_CHAT,
            A.GEN_AI_PROVIDER_NAME: gen_ai_provider or provider or "openalice",
        }
        if model:
            attrs[A.GEN_AI_REQUEST_MODEL] = model
        if provider:
            attrs[A.PROVIDER] = provider
        if stream:
            attrs[A.GEN_AI_REQUEST_STREAM] = True
        metric_attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: A.OP_CHAT,
            A.GEN_AI_PROVIDER_NAME: attrs[A.GEN_AI_PROVIDER_NAME],
        }
        if model:
            metric_attrs[A.GEN_AI_REQUEST_MODEL] = model
        if turn_type:
            metric_attrs[A.TURN_TYPE] = turn_type
        if plan is not None:
            metric_attrs[A.SPEC_METHOD] = plan.method
        if tenant:
            attrs[A.TENANT] = metric_attrs[A.TENANT] = tenant
        name = f"{A.OP_CHAT} {model}" if model else A.OP_CHAT
        # What sampling may look at goes in at creation; the rest only when the span records
        # (with the no-op global API it does not, and the call then costs next to nothing).
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.CLIENT, attributes=attrs)
        if span.is_recording():
            span.set_attributes(_chat_details(
                conversation_id=conversation_id, turn_type=turn_type, step=step, agent=agent,
                plan=plan, request=request, record_content=self.record_content,
            ))  # fmt: skip
        return ChatCall(self, span, metric_attrs)

    def record_chat_metrics(
        self,
        labels: dict[str, Any],
        *,
        duration_s: float,
        ttft_s: float | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        speculation: SpeculationOutcome | None = None,
        output_s: float | None = None,
    ) -> None:
        labels = self.label_bounds.bound(labels)
        self._op_duration.record(duration_s, labels)
        if ttft_s is not None:
            self._ttfc.record(ttft_s, labels)
        if input_tokens is not None:
            self._token_usage.record(int(input_tokens), {**labels, A.GEN_AI_TOKEN_TYPE: "input"})
        if output_tokens is not None:
            self._token_usage.record(int(output_tokens), {**labels, A.GEN_AI_TOKEN_TYPE: "output"})
        tps = speculation.tokens_per_second if speculation is not None else None
        if tps is None and output_tokens and output_s:
            tps = output_tokens / output_s
        if tps:
            self._tokens_per_second.record(float(tps), labels)
        if speculation is not None and speculation.proposed and speculation.gamma:
            # Mean drafts accepted per verify round of this call (one record per call, not per round:
            # a long generation would otherwise pay for hundreds of records).
            rounds = speculation.proposed / speculation.gamma
            self._accepted_drafts_per_round.record(speculation.accepted / rounds, labels)


def _chat_details(
    *, conversation_id: str | None, turn_type: str | None, step: int | None, agent: str | None,
    plan: SpeculationPlan | None, request: ChatRequest | None, record_content: bool,
) -> dict[str, Any]:  # fmt: skip
    """A chat span's attributes that sampling does not look at: built only for a span that records
    (apart from start_chat, which stays under C901's bound)."""
    more: dict[str, Any] = {}
    if conversation_id:
        more[A.GEN_AI_CONVERSATION_ID] = conversation_id
    if turn_type:
        more[A.TURN_TYPE] = turn_type
    if step is not None:
        more[A.STEP] = step
    if agent:
        more[A.GEN_AI_AGENT_NAME] = agent
    if plan is not None:
        # The plan as made; the figures the provider reports on finish() override it.
        more.update(plan_attributes(plan))
    if request is not None:
        more.update(request_attributes(request, record_content))
    return more


def _span_attr(span: Span, key: str) -> Any:
    attrs = getattr(span, "attributes", None)
    return attrs.get(key) if attrs else None


def current_trace_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) hex of the current span, for log lines; None outside any span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")

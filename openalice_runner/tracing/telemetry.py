"""RunnerTelemetry: the spans and metrics of turns, model calls and tool steps.

Library code: it takes a tracer/meter provider if given and otherwise uses the global OpenTelemetry API
(a no-op until an application installs providers). It never installs anything itself.

Span tree of one agent turn:
    invoke_agent {agent}            INTERNAL  (turn_span / start_turn)
      chat {model}                  CLIENT    (start_chat, used by InstrumentedProvider)
      execute_tool {name}           INTERNAL  (tool_span / start_tool / record_tool_call)
      chat {model}                  ...
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import Histogram
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from openalice_runner.first_token import FirstTokenBreakdown
from openalice_runner.redaction import redact
from openalice_runner.speculation import SpeculationOutcome, SpeculationPlan, with_old_keys
from openalice_runner.tracing import attributes as A
from openalice_runner.tracing.labels import LabelBounds
from openalice_runner.types import ChatRequest

SCOPE = "openalice_runner"
_NS_PER_S = 1_000_000_000


def _version() -> str:
    from openalice_runner import __version__

    return __version__


def _to_jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json", exclude_none=True)
    if isinstance(obj, list | tuple):
        return [_to_jsonable(o) for o in obj]
    return obj


def error_type_of(exc: BaseException) -> str:
    """Low-cardinality error class for `error.type`: an HTTP status when the error carries one."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return str(status)
    return type(exc).__qualname__


def mark_error(span: Span, exc: BaseException) -> str:
    etype = error_type_of(exc)
    span.set_attribute(A.ERROR_TYPE, etype)
    # Upstream messages can echo keys: redacted before they reach an exporter.
    span.set_status(Status(StatusCode.ERROR, redact(f"{type(exc).__name__}: {exc}")[:500]))
    return etype


def plan_attributes(plan: SpeculationPlan) -> dict[str, Any]:
    """`openalice.speculation.*` of a policy's decision, as made."""
    out: dict[str, Any] = {
        A.SPEC_METHOD: plan.method,
        A.SPEC_GAMMA: plan.gamma,
        A.SPEC_RULE: plan.rule,
        A.SPEC_POLICY_VERSION: plan.policy_version,
    }
    if plan.reason:
        out[A.SPEC_REASON] = plan.reason
    if plan.pool:
        out[A.POOL] = plan.pool
    return out


def outcome_attributes(outcome: SpeculationOutcome) -> dict[str, Any]:
    """`openalice.speculation.*` and `openalice.latency.*` (ms: queue, ttft, decode after the first
    token, draft, verify) of what a call's speculation did."""
    out: dict[str, Any] = {
        A.SPEC_METHOD: outcome.method,
        A.SPEC_GAMMA: outcome.gamma,
        A.SPEC_PROPOSED: outcome.proposed,
        A.SPEC_ACCEPTED: outcome.accepted,
        A.SPEC_ACCEPTANCE_RATE: outcome.acceptance_rate,
        A.SPEC_TARGET_PASSES: outcome.target_passes,
    }
    optional = (
        (A.SPEC_RULE, outcome.rule),
        (A.SPEC_POLICY_VERSION, outcome.policy_version),
        (A.POOL, outcome.pool),
        (A.SPEC_TOKENS_PER_PASS, outcome.tokens_per_pass),
        (A.TOKENS_PER_SECOND, outcome.tokens_per_second),
    )
    out.update((key, value) for key, value in optional if value is not None)
    for key, seconds in (
        (A.LATENCY_QUEUE_MS, outcome.queue_s),
        (A.LATENCY_TTFT_MS, outcome.ttft_s),
        (A.LATENCY_DECODE_MS, outcome.decode_s),
        (A.LATENCY_DRAFT_MS, outcome.draft_s),
        (A.LATENCY_VERIFY_MS, outcome.verify_s),
    ):
        if seconds is not None:
            out[key] = round(seconds * 1000.0, 3)
    if outcome.first_token is not None:
        out.update(first_token_attributes(outcome.first_token))
    return with_old_keys("span", out)


def first_token_attributes(breakdown: FirstTokenBreakdown) -> dict[str, float]:
    """`openalice.latency.first_token.{part}_ms` of each part measured, and `.total_ms`, their sum."""
    out = {f"{A.LATENCY_FIRST_TOKEN}.{part}_ms": round(seconds * 1000.0, 3) for part, seconds in breakdown.parts}
    out[f"{A.LATENCY_FIRST_TOKEN}.total_ms"] = round(breakdown.total_s * 1000.0, 3)
    return out


@dataclass
class ChatCall:
    """One in-flight model call: its span plus what its metrics need when it ends."""

    telemetry: RunnerTelemetry
    span: Span
    metric_attrs: dict[str, Any]
    t0: float = field(default_factory=time.perf_counter)
    first_chunk_s: float | None = None
    ended: bool = False

    def first_chunk(self) -> None:
        """Mark the first streamed chunk that carries content (time to first chunk)."""
        if self.first_chunk_s is None:
            self.first_chunk_s = time.perf_counter() - self.t0
            self.span.set_attribute(A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, self.first_chunk_s)

    def finish(
        self,
        *,
        response_id: str | None = None,
        response_model: str | None = None,
        finish_reason: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        speculation: SpeculationOutcome | None = None,
        output_message: Any = None,
        cached_input_tokens: int | None = None,
    ) -> None:
        if self.ended:
            return
        self.ended = True
        span, tel = self.span, self.telemetry
        duration_s = time.perf_counter() - self.t0
        if span.is_recording():
            self._set_result_attributes(
                response_id,
                response_model,
                finish_reason,
                input_tokens,
                output_tokens,
                speculation,
                output_message,
                cached_input_tokens,
            )
        # The method actually used (the provider may have downgraded the decision) labels the metrics.
        labels = dict(self.metric_attrs)
        if speculation is not None:
            labels[A.SPEC_METHOD] = speculation.method
        tel.record_chat_metrics(
            labels,
            duration_s=duration_s,
            ttft_s=self.first_chunk_s,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            speculation=speculation,
            output_s=duration_s,
        )
        span.end()

    def _set_result_attributes(
        self,
        response_id: str | None,
        response_model: str | None,
        finish_reason: str | None,
        input_tokens: int | None,
        output_tokens: int | None,
        speculation: SpeculationOutcome | None,
        output_message: Any,
        cached_input_tokens: int | None = None,
    ) -> None:
        attrs: dict[str, Any] = {}
        if response_id:
            attrs[A.GEN_AI_RESPONSE_ID] = response_id
        if response_model:
            attrs[A.GEN_AI_RESPONSE_MODEL] = response_model
        if finish_reason:
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = (finish_reason,)
        if input_tokens is not None:
            attrs[A.GEN_AI_USAGE_INPUT_TOKENS] = int(input_tokens)
        if output_tokens is not None:
            attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] = int(output_tokens)
        if cached_input_tokens is not None:
            attrs[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = int(cached_input_tokens)
        if speculation is not None:
            attrs.update(outcome_attributes(speculation))
            for i, (tokens, seconds) in enumerate(speculation.first_token.chunks if speculation.first_token else ()):
                self.span.add_event(A.EVENT_PREFILL_CHUNK, {A.PREFILL_CHUNK_INDEX: i, A.PREFILL_CHUNK_TOKENS: tokens,
                                                            A.PREFILL_CHUNK_MS: round(seconds * 1000.0, 3)})
        if self.first_chunk_s is not None and A.LATENCY_TTFT_MS not in attrs:
            attrs[A.LATENCY_TTFT_MS] = round(self.first_chunk_s * 1000.0, 3)
        if self.telemetry.record_content and output_message is not None:
            attrs[A.GEN_AI_OUTPUT_MESSAGES] = json.dumps([_to_jsonable(output_message)], default=str)
        self.span.set_attributes(attrs)

    def fail(self, exc: BaseException) -> None:
        if self.ended:
            return
        self.ended = True
        etype = mark_error(self.span, exc)
        labels = dict(self.metric_attrs)
        labels[A.ERROR_TYPE] = etype
        self.telemetry.record_chat_metrics(labels, duration_s=time.perf_counter() - self.t0)
        self.span.end()


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
        decision: SpeculationPlan | None = None,
        request: ChatRequest | None = None,
        stream: bool = False,
        parent: otel_context.Context | None = None,
        tenant: str | None = None,
    ) -> ChatCall:
        """Open a `chat {model}` CLIENT span for one call of a turn (`decision`: the policy's plan;
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
        if decision is not None:
            metric_attrs[A.SPEC_METHOD] = decision.method
        if tenant:
            attrs[A.TENANT] = metric_attrs[A.TENANT] = tenant
        name = f"{A.OP_CHAT} {model}" if model else A.OP_CHAT
        # What sampling may look at goes in at creation; the rest only when the span records
        # (with the no-op global API it does not, and the call then costs next to nothing).
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.CLIENT, attributes=attrs)
        if span.is_recording():
            more: dict[str, Any] = {}
            if conversation_id:
                more[A.GEN_AI_CONVERSATION_ID] = conversation_id
            if turn_type:
                more[A.TURN_TYPE] = turn_type
            if step is not None:
                more[A.STEP] = step
            if agent:
                more[A.GEN_AI_AGENT_NAME] = agent
            if decision is not None:
                # The decision as made; the figures the provider reports on finish() override it.
                more.update(plan_attributes(decision))
            if request is not None:
                more.update(_request_attributes(request, self.record_content))
            span.set_attributes(more)
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


def _span_attr(span: Span, key: str) -> Any:
    attrs = getattr(span, "attributes", None)
    return attrs.get(key) if attrs else None


def _request_attributes(request: ChatRequest, record_content: bool) -> dict[str, Any]:
    """gen_ai.request.* of a ChatRequest."""
    out: dict[str, Any] = {}
    for key, value in (
        (A.GEN_AI_REQUEST_TEMPERATURE, request.temperature),
        (A.GEN_AI_REQUEST_TOP_P, request.top_p),
        (A.GEN_AI_REQUEST_SEED, request.seed),
        (A.GEN_AI_REQUEST_MAX_TOKENS, request.max_tokens),
    ):
        if value is not None:
            out[key] = value
    if record_content:  # stop strings are the caller's text, as the messages are
        if request.stop:
            out[A.GEN_AI_REQUEST_STOP_SEQUENCES] = tuple(request.stop)
        out[A.GEN_AI_INPUT_MESSAGES] = json.dumps(_to_jsonable(list(request.messages)), default=str)
    return out


def current_trace_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) hex of the current span, for log lines; None outside any span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")

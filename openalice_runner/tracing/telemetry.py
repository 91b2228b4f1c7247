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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from openalice_runner.providers.secrets import redact
from openalice_runner.tracing import attributes as A

SCOPE = "openalice_runner"
_NS_PER_S = 1_000_000_000


def _version() -> str:
    from openalice_runner import __version__

    return __version__


_MISSING = object()


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """Read a field from a pydantic model, dataclass or dict alike (hot: called dozens of times a call)."""
    if obj is None:
        return default
    if type(obj) is dict:
        return obj.get(name, default)
    value = getattr(obj, name, _MISSING)
    if value is not _MISSING:
        return value
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return default


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


def speculation_attributes(spec: Any) -> dict[str, Any]:
    """`openalice.speculation.*` and `openalice.latency.*` from a SpeculationInfo, GenerationStats or dict.

    Accepts both naming styles (SpeculationInfo: proposed/accepted; GenerationStats: draft_proposed/...).
    Latency parts in ms: queue, ttft, decode (after the first token), draft, verify.
    """
    out: dict[str, Any] = {}
    if spec is None:
        return out

    def put(key: str, value: Any, cast: type) -> None:
        if value is not None:
            out[key] = cast(value)

    put(A.SPEC_METHOD, _get(spec, "method"), str)
    put(A.SPEC_GAMMA, _get(spec, "gamma"), int)
    put(A.SPEC_RULE, _get(spec, "rule"), str)
    put(A.SPEC_REASON, _get(spec, "reason"), str)
    put(A.SPEC_POLICY_VERSION, _get(spec, "policy_version"), str)
    put(A.SPEC_PROPOSED, _first(spec, "proposed", "draft_proposed"), int)
    put(A.SPEC_ACCEPTED, _first(spec, "accepted", "draft_accepted"), int)
    put(A.SPEC_ACCEPTANCE_RATE, _get(spec, "acceptance_rate"), float)
    put(A.SPEC_TARGET_PASSES, _get(spec, "target_passes"), int)
    put(A.SPEC_MEAN_TOKENS_PER_PASS, _get(spec, "mean_tokens_per_pass"), float)
    put(A.TOKENS_PER_SECOND, _get(spec, "tokens_per_second"), float)
    put(A.POOL, _get(spec, "pool"), str)

    ttft_s = _first(spec, "ttft_s")
    total_s = _first(spec, "total_s")
    for key, ms_name, s_name in (
        (A.LATENCY_QUEUE_MS, "queue_ms", "queue_s"),
        (A.LATENCY_TTFT_MS, "ttft_ms", "ttft_s"),
        (A.LATENCY_DECODE_MS, "decode_ms", "decode_s"),
        (A.LATENCY_DRAFT_MS, "draft_ms", "draft_s"),
        (A.LATENCY_VERIFY_MS, "verify_ms", "verify_s"),
    ):
        ms = _get(spec, ms_name)
        if ms is None and (s := _get(spec, s_name)) is not None:
            ms = s * 1000.0
        if ms is not None:
            out[key] = round(float(ms), 3)
    if A.LATENCY_DECODE_MS not in out and ttft_s is not None and total_s is not None:
        out[A.LATENCY_DECODE_MS] = round(max(0.0, total_s - ttft_s) * 1000.0, 3)
    return out


def _first(obj: Any, *names: str) -> Any:
    for name in names:
        value = _get(obj, name)
        if value is not None:
            return value
    return None


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
        speculation: Any = None,
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
        if (method := _get(speculation, "method")) is not None:
            labels[A.SPEC_METHOD] = str(method)
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
        speculation: Any,
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
        spec_attrs = speculation_attributes(speculation)
        attrs.update(spec_attrs)
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


class RunnerTelemetry:
    """Spans and metrics for turns, model calls and tool steps (see module docstring)."""

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        record_content: bool = False,
    ) -> None:
        self.record_content = record_content
        version = _version()
        self.tracer = trace.get_tracer(SCOPE, version, tracer_provider=tracer_provider)
        meter = metrics.get_meter(SCOPE, version, meter_provider=meter_provider)
        self._op_duration = meter.create_histogram(
            A.METRIC_OPERATION_DURATION,
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=list(A.DURATION_BUCKETS_S),
        )
        self._token_usage = meter.create_histogram(
            A.METRIC_TOKEN_USAGE,
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=list(A.TOKEN_BUCKETS),
        )
        self._ttfc = meter.create_histogram(
            A.METRIC_TIME_TO_FIRST_CHUNK,
            unit="s",
            description="Time to receive the first chunk in a streaming operation.",
            explicit_bucket_boundaries_advisory=list(A.DURATION_BUCKETS_S),
        )
        self._agent_duration = meter.create_histogram(
            A.METRIC_INVOKE_AGENT_DURATION,
            unit="s",
            description="Duration of an agent turn.",
            explicit_bucket_boundaries_advisory=list(A.DURATION_BUCKETS_S),
        )
        self._tool_duration = meter.create_histogram(
            A.METRIC_EXECUTE_TOOL_DURATION,
            unit="s",
            description="Duration of a tool execution.",
            explicit_bucket_boundaries_advisory=list(A.DURATION_BUCKETS_S),
        )
        self._accepted_length = meter.create_histogram(
            A.METRIC_ACCEPTED_LENGTH,
            unit="{token}",
            description="Mean draft tokens accepted per verify round, one value per model call.",
            explicit_bucket_boundaries_advisory=list(A.ACCEPTED_LENGTH_BUCKETS),
        )
        self._tokens_per_second = meter.create_histogram(
            A.METRIC_TOKENS_PER_SECOND,
            unit="{token}/s",
            description="Output tokens per second of a model call, prefill included.",
            explicit_bucket_boundaries_advisory=list(A.TOKENS_PER_SECOND_BUCKETS),
        )

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
            self._agent_duration.record((end_ns - start_ns) / _NS_PER_S, labels)

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
            self._tool_duration.record((end_ns - start_ns) / _NS_PER_S, labels)

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
        ctx: Any = None,
        request: Any = None,
        stream: bool = False,
        parent: otel_context.Context | None = None,
    ) -> ChatCall:
        """Open a `chat {model}` CLIENT span. `ctx` is a CallContext; `request` a ChatRequest (or alike)."""
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
        turn_type = _get(ctx, "turn_type")
        decision = _get(ctx, "decision")
        metric_attrs: dict[str, Any] = {
            A.GEN_AI_OPERATION_NAME: A.OP_CHAT,
            A.GEN_AI_PROVIDER_NAME: attrs[A.GEN_AI_PROVIDER_NAME],
        }
        if model:
            metric_attrs[A.GEN_AI_REQUEST_MODEL] = model
        if turn_type:
            metric_attrs[A.TURN_TYPE] = str(turn_type)
        if (method := _get(decision, "method")) is not None:
            metric_attrs[A.SPEC_METHOD] = str(method)
        name = f"{A.OP_CHAT} {model}" if model else A.OP_CHAT
        # What sampling may look at goes in at creation; the rest only when the span records
        # (with the no-op global API it does not, and the call then costs next to nothing).
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.CLIENT, attributes=attrs)
        if span.is_recording():
            more: dict[str, Any] = {}
            conversation_id = _get(ctx, "conversation_id")
            step = _get(ctx, "step")
            agent = _get(ctx, "agent")
            if conversation_id:
                more[A.GEN_AI_CONVERSATION_ID] = str(conversation_id)
            if turn_type:
                more[A.TURN_TYPE] = str(turn_type)
            if step is not None:
                more[A.STEP] = int(step)
            if agent:
                more[A.GEN_AI_AGENT_NAME] = str(agent)
            if decision is not None:
                # The decision as made; the figures the provider reports on finish() override it.
                more.update(speculation_attributes(decision))
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
        speculation: Any = None,
        output_s: float | None = None,
    ) -> None:
        self._op_duration.record(duration_s, labels)
        if ttft_s is not None:
            self._ttfc.record(ttft_s, labels)
        if input_tokens is not None:
            self._token_usage.record(int(input_tokens), {**labels, A.GEN_AI_TOKEN_TYPE: "input"})
        if output_tokens is not None:
            self._token_usage.record(int(output_tokens), {**labels, A.GEN_AI_TOKEN_TYPE: "output"})
        tps = _get(speculation, "tokens_per_second")
        if tps is None and output_tokens and output_s:
            tps = output_tokens / output_s
        if tps:
            self._tokens_per_second.record(float(tps), labels)
        proposed = _first(speculation, "proposed", "draft_proposed")
        gamma = _get(speculation, "gamma")
        if proposed and gamma:
            # Mean drafts accepted per verify round of this call (one record per call, not per round:
            # a long generation would otherwise pay for hundreds of records).
            rounds = proposed / gamma
            accepted = _first(speculation, "accepted", "draft_accepted") or 0
            self._accepted_length.record(accepted / rounds, labels)


def _span_attr(span: Span, key: str) -> Any:
    attrs = getattr(span, "attributes", None)
    return attrs.get(key) if attrs else None


def _request_attributes(request: Any, record_content: bool) -> dict[str, Any]:
    """gen_ai.request.* from a ChatRequest (sampling may be flat or under `.sampling`)."""
    if request is None:
        return {}
    out: dict[str, Any] = {}
    sampling = request  # ChatRequest carries the sampling fields itself
    for key, name in (
        (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
        (A.GEN_AI_REQUEST_TOP_P, "top_p"),
        (A.GEN_AI_REQUEST_SEED, "seed"),
        (A.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"),
    ):
        value = _get(sampling, name)
        if value is not None and isinstance(value, int | float):
            out[key] = value
    stop = _get(sampling, "stop")
    if stop:
        out[A.GEN_AI_REQUEST_STOP_SEQUENCES] = (stop,) if isinstance(stop, str) else tuple(stop)
    if record_content:
        messages = _get(request, "messages")
        if messages is not None:
            out[A.GEN_AI_INPUT_MESSAGES] = json.dumps(_to_jsonable(list(messages)), default=str)
    return out


def current_trace_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) hex of the current span, for log lines; None outside any span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")

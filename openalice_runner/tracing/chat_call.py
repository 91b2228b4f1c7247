"""A `chat {model}` span once open (ChatCall): the attributes of the policy's plan, of the request,
of what speculation did, and how the call ends (finished, failed), with its metrics."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Span, Status, StatusCode

from openalice_runner.first_token import FirstTokenBreakdown
from openalice_runner.redaction import redact
from openalice_runner.speculation import SpeculationOutcome, SpeculationPlan, with_old_keys
from openalice_runner.tracing import attributes as A
from openalice_runner.types import ChatRequest

if TYPE_CHECKING:
    from openalice_runner.tracing.telemetry import RunnerTelemetry


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
    """`openalice.speculation.*` of a policy's plan, as made."""
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
        # The method actually used (the provider may have downgraded the plan) labels the metrics.
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


def request_attributes(request: ChatRequest, record_content: bool) -> dict[str, Any]:
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

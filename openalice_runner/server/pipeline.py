"""The request path every wire runs: one request from its body to its answer (plain JSON or SSE).

A wire (server/wires/) turns its body into the chat request (ServerChatRequest) and formats the answer;
everything between is here, the same for every wire: the request's turn context (conversation, turn
type, step), its deadline, the admission pre-check (429 before any work), the turn span it runs under
(server/turns.py), the runner call (policy, providers, fallback) and the metrics it counts. State lives
in `RequestPipeline`, handed in by create_app; nothing here is shared through a closure.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import structlog
from fastapi import Request
from fastapi.responses import Response
from opentelemetry import context as otel_context
from opentelemetry import trace

from openalice_runner.providers.base import OTEL_CONTEXT_KEY, CallContext
from openalice_runner.providers.streams import ChatStream
from openalice_runner.server.context import (
    TurnContext,
    caller_trace_context,
    mark_sources,
    stamped,
    turn_context,
    with_sources,
)
from openalice_runner.server.deadline import ClientGone, Deadline, DeadlineExceeded, race, request_deadline
from openalice_runner.server.mapping import api_error_from
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.release.paced import PaceRates
from openalice_runner.server.runner_protocol import ServedRunner
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.streaming import GuardedStreamingResponse, SSEStream
from openalice_runner.server.tenants import RequestSettings, request_settings
from openalice_runner.server.turns import Step, TurnTracker
from openalice_runner.server.validation import ServerChatRequest
from openalice_runner.server.wires.base import Wire, WireCall
from openalice_runner.tracing.labels import LabelBounds
from openalice_runner.types import ChatChunk, ChatResult

log = structlog.get_logger("openalice_runner.server")


class RequestPipeline:
    """The request path over one runner; `handler(wire)` is a route's handler for that wire."""

    def __init__(
        self,
        runner: ServedRunner,
        *,
        settings: ServerSettings,
        tracker: TurnTracker,
        metrics: ServerMetrics,
        bounds: LabelBounds,
    ) -> None:
        self.runner = runner
        self.settings = settings
        self.tracker = tracker
        self.metrics = metrics
        self.bounds = bounds  # turn types as metric labels
        self.pace_rates = PaceRates()  # recent streams' decode rates, where a paced stream starts

    def handler(self, wire: Wire) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            return await self.serve(request, wire)

        handle.__name__ = f"{wire.name}_request"  # the route's name in the OpenAPI document
        return handle

    async def serve(self, request: Request, wire: Wire) -> Response:
        # parsed, validated, checked and translated off the loop (server/body.py)
        t0 = time.perf_counter()
        call = await wire.read(request, self.settings)
        return await self.run(request, wire, call, parse_s=time.perf_counter() - t0)

    async def run(self, request: Request, wire: Wire, call: WireCall, parse_s: float | None = None) -> Response:
        """`call`, read by `wire`, served and answered in the wire's shape (`parse_s`: the reading took,
        part of the call's time before its first token)."""
        body = call.body
        # the request's tenant (its key: server/guard.py) and what it runs under: its tenant's settings,
        # else serve's
        served = request_settings(getattr(request.state, "tenant", None), self.settings)
        # stated (headers, metadata), else inferred from the wire's session keys and the body's shape
        tc = turn_context(request.headers, body.metadata, body, session=call.conversation_id,
                          session_key=call.conversation_source)
        deadline = request_deadline(request.headers, body.timeout, self.settings.request_timeout_s)
        refused = self._refusal(tc.turn_type, body.model)
        if refused is not None:  # every provider of the route is full: 429 before any work
            labels = {"turn_type": self.bounds.turn_type(tc.turn_type), "stream": str(body.stream).lower()}
            self.metrics.chat_completions.labels(**labels, outcome="refused").inc()
            raise api_error_from(refused)
        step = self.tracker.begin(
            conversation_id=tc.conversation_id,
            turn_type=tc.turn_type,
            agent=tc.agent,
            parent=_turn_parent(request, tracked=tc.conversation_id is not None),
            messages=body.messages,
            step=tc.step,
            tenant=served.tenant,
        )
        self.metrics.open_turns.set(len(self.tracker))
        mark_sources(step.turn.span, tc)
        ctx = CallContext(
            conversation_id=tc.conversation_id,
            turn_type=tc.turn_type,
            step=step.step,
            agent=tc.agent,
            model=body.model,
            attributes={OTEL_CONTEXT_KEY: step.turn.context},
            tenant=served.tenant,
            parse_s=parse_s,
        )
        span_ctx = step.turn.span.get_span_context()
        request.state.trace_ids = (format(span_ctx.trace_id, "032x"), format(span_ctx.span_id, "016x"))
        if body.stream:
            return await self._stream(wire, call, ctx, step, deadline, request, tc, served)
        return await self._complete(wire, call, ctx, step, deadline, request, tc, served)

    def _refusal(self, turn_type: str, model: str | None) -> Exception | None:
        try:
            return self.runner.refusal(turn_type, model)
        except LookupError as exc:
            error = api_error_from(exc, report=False)
            if error.code == "model_not_found":  # no route takes the name: 404 before any work
                raise error from None
            return None  # any other "no route": runner.chat says so in its own words

    def _failed(self, step: Step, labels: dict[str, str], exc: BaseException) -> None:
        self.tracker.finish(step, error=exc)
        self.metrics.chat_completions.labels(**labels, outcome=_outcome(exc)).inc()
        reason = _cancel_reason(exc)
        if reason is not None:
            self.metrics.cancelled.labels(reason=reason).inc()

    async def _complete(
        self, wire: Wire, call: WireCall, ctx: CallContext, step: Step, deadline: Deadline, request: Request,
        tc: TurnContext, served: RequestSettings,
    ) -> Response:
        body: ServerChatRequest = call.body
        labels = {"turn_type": self.bounds.turn_type(ctx.turn_type), "stream": "false"}
        metrics = self.metrics
        metrics.in_flight.inc()
        try:
            with trace.use_span(
                step.turn.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                # Raced against the deadline and the client leaving: either stops the generation.
                result = await race(self.runner.chat(body, ctx), deadline, request.receive)
        except ClientGone as exc:
            self._failed(step, labels, exc)
            return Response(status_code=499)  # nobody reads it; the access log shows what happened
        except BaseException as exc:
            self._failed(step, labels, exc)
            if not isinstance(exc, Exception):
                raise  # cancellation and exits propagate as themselves
            raise api_error_from(exc) from exc
        finally:
            metrics.in_flight.dec()
            metrics.open_turns.set(len(self.tracker))
        self.tracker.finish(
            step,
            finish_reason=result.finish_reason,
            tool_calls=[(call.id, call.function.name) for call in result.tool_calls],
        )
        metrics.open_turns.set(len(self.tracker))
        metrics.chat_completions.labels(**labels, outcome="ok").inc()
        if result.usage is not None:  # None: the provider's server sent no usage (unknown, not 0)
            metrics.tokens.labels(type="input").inc(result.usage.prompt_tokens)
            metrics.tokens.labels(type="output").inc(result.usage.completion_tokens)
        call.headers.update(budget_header(result))
        return wire.reply(with_sources(result, tc, served.speculation_info), call)

    async def _stream(
        self, wire: Wire, call: WireCall, ctx: CallContext, step: Step, deadline: Deadline, request: Request,
        tc: TurnContext, served: RequestSettings,
    ) -> Response:
        body: ServerChatRequest = call.body
        labels = {"turn_type": self.bounds.turn_type(ctx.turn_type), "stream": "true"}
        t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        opened = self.runner.stream(body, ctx)
        try:
            # The stream is opened (a slot taken) and its first chunk awaited before answering, so a
            # failure up to here is a real HTTP status; the stream is closed again when it fails.
            chunks, first = await race(_open_first(opened, t0 if served.stream_release.padded else None),
                                       deadline, request.receive)
        except BaseException as exc:
            self.metrics.in_flight.dec()
            self._failed(step, labels, exc)
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            if not isinstance(exc, Exception):
                raise
            raise api_error_from(exc) from exc
        stream = SSEStream(
            first=first and with_sources(first, tc, served.speculation_info),
            opened=opened,
            chunks=stamped(chunks, tc, served.speculation_info),
            step=step,
            format=wire.stream_format(call),
            turn_type=labels["turn_type"],  # the stream's metric label
            t0=t0,
            tracker=self.tracker,
            metrics=self.metrics,
            to_api_error=api_error_from,
            deadline=deadline,
            release=served.stream_release,
            rates=self.pace_rates,
            # per tenant and turn type (paced.py, PaceRates)
            rate_key=f"{served.tenant or ''}\x00{body.model or ''}\x00{tc.turn_type}",
        )
        headers = {"Cache-Control": "no-cache", **call.headers, **budget_header(first)}
        return GuardedStreamingResponse(stream, headers=headers)


MAX_TOKENS_HEADER = "x-openalice-max-tokens"
HEAD_QUANTUM_S = 0.1  # a padded stream's headers leave on this grid after the request (_open_first)


def budget_header(reply: ChatResult | ChatChunk | None) -> dict[str, str]:
    """The max_tokens the reply ran under, clamped to the context (docs/agent-runtimes.md, "Budget"),
    where the provider knows it."""
    budget = reply.budget if reply is not None else None
    return {} if budget is None else {MAX_TOKENS_HEADER: str(budget)}


def _turn_parent(request: Request, *, tracked: bool) -> Any:
    """Parent of a new turn span: the request's HTTP server span where there is one (it continues the
    caller's traceparent), so the two share a trace. A conversation's turn outlives the request that
    opens it and stays a child of that request's server span. Without a server span: the caller's
    span (traceparent), or a trace of its own."""
    server = _server_span(request)
    if server is not None:
        return trace.set_span_in_context(server)
    caller = caller_trace_context(request.headers)
    if tracked:
        return caller or otel_context.Context()
    if trace.get_current_span().get_span_context().is_valid:
        return None  # the current context
    return caller


def _server_span(request: Request) -> Any:
    """FastAPI's HTTP server span of this request (its telemetry keeps it in the scope without making it
    current), or None where tracing is off."""
    span = getattr(request.scope.get("fastapi.telemetry"), "span", None)  # FastAPI's object, not ours
    if span is None or not span.get_span_context().is_valid:
        return None
    return span


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, ClientGone | asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    error = api_error_from(exc, report=False) if isinstance(exc, Exception) else None
    return "refused" if error is not None and error.status_code == 429 else "error"


def _cancel_reason(exc: BaseException) -> str | None:
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, ClientGone | asyncio.CancelledError | GeneratorExit):
        return "client_gone"
    return None


async def _open_first(
    opened: AbstractAsyncContextManager[ChatStream], start: float | None = None,
) -> tuple[ChatStream, ChatChunk | None]:
    """Enter the stream's context and read its first chunk (None: the stream is empty). On failure or
    cancellation the context is left at once, with the error, so the generation stops here.
    `start` (the request's perf_counter, in the padded release modes): the answer waits for the next
    multiple of HEAD_QUANTUM_S after it, so the time to the response's headers, the first thing an
    observer sees, says no more than which quantum the first token fell in."""
    chunks = await opened.__aenter__()
    try:
        first = await anext(chunks, None)  # StopAsyncIteration cannot leave a task as itself
        if start is not None:
            elapsed = time.perf_counter() - start
            await asyncio.sleep(math.ceil(elapsed / HEAD_QUANTUM_S) * HEAD_QUANTUM_S - elapsed)
        return chunks, first
    except BaseException as exc:
        try:
            await opened.__aexit__(type(exc), exc, exc.__traceback__)
        except Exception:  # already failed; the first error is what counts
            log.debug("closing a failed stream failed", exc_info=True)
        raise

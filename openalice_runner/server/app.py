"""The sidecar: an OpenAI-compatible HTTP API over a Runner.

Routes: POST /v1/chat/completions (plain and SSE), GET /v1/models, GET /v1/policy, GET /health, GET /metrics.
Every request of a conversation lands in its agent turn (server/turns.py), so the trace shows the turn's
model calls and the tool steps between them under one `invoke_agent` span.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from openalice_runner.providers.base import CallContext
from openalice_runner.providers.instrumented import OTEL_CONTEXT_KEY
from openalice_runner.providers.streams import ChatStream
from openalice_runner.redaction import register_secret
from openalice_runner.server.body import read_chat_request
from openalice_runner.server.connections import Drain
from openalice_runner.server.context import caller_trace_context, turn_context
from openalice_runner.server.deadline import ClientGone, Deadline, DeadlineExceeded, race, request_deadline
from openalice_runner.server.error_log import ERRORS
from openalice_runner.server.errors import APIError, install_error_handlers
from openalice_runner.server.guard import PUBLIC_PATHS, GuardMiddleware
from openalice_runner.server.health import authenticated, file_status
from openalice_runner.server.mapping import api_error_from as _map_error
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.routing_watch import RoutingWatcher
from openalice_runner.server.runner_protocol import ServedRunner
from openalice_runner.server.streaming import GuardedStreamingResponse, SSEStream
from openalice_runner.server.turns import Step, TurnTracker
from openalice_runner.server.validation import ServerChatRequest, check_request
from openalice_runner.tracing.labels import LabelBounds
from openalice_runner.tracing.telemetry import RunnerTelemetry
from openalice_runner.types import ChatChunk

log = structlog.get_logger("openalice_runner.server")


@dataclass
class ServerSettings:
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    turn_idle_timeout_s: float = 300.0
    max_open_turns: int = 4096
    watch_policy: bool = True
    request_timeout_s: float = 300.0  # caps the deadline a client asks for (server/deadline.py)
    max_tokens_limit: int = 32_768  # larger max_tokens are refused as absurd (400)
    providers_file: str | None = None  # watched and applied live when it validates (routing_watch.py)
    watch_interval_s: float = 1.0
    metrics_public: bool = False  # /metrics without the API key even when one is set
    metrics_max_age_s: float = 0.0  # > 0: scrapes within this long of a render reuse it


def create_app(
    runner: ServedRunner,
    *,
    telemetry: RunnerTelemetry | None = None,
    settings: ServerSettings | None = None,
    metrics: ServerMetrics | None = None,
    on_shutdown: Any = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
) -> FastAPI:
    """`runner`: a Runner (server/runner_protocol.py says what of it is used). `on_shutdown`: callable run last
    (the CLI flushes the trace exporters there). `tracer_provider`/`meter_provider`: for FastAPI's own
    HTTP server spans and metrics (None: the global ones)."""
    settings = settings or ServerSettings()
    telemetry = telemetry or RunnerTelemetry()
    metrics = metrics or ServerMetrics()
    metrics.track_runner(runner)
    # Turn types a client sends become metric labels only when configured (policy, routes) or standard.
    bounds = LabelBounds(turn_types=_ConfiguredTurnTypes(runner))
    telemetry.label_bounds = bounds
    register_secret(settings.api_key)
    tracker = TurnTracker(
        telemetry, max_open=settings.max_open_turns, idle_timeout_s=settings.turn_idle_timeout_s
    )
    routing_watch = (
        RoutingWatcher(runner, settings.providers_file, settings.watch_interval_s)
        if settings.providers_file
        else None
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        policy = runner.policy
        if settings.watch_policy and policy is not None:
            policy.start_watching()
        # Load embedded models before taking traffic: the first request should not pay for it.
        for provider in runner.providers.values():
            await provider.ensure_loaded()
        reaper = asyncio.create_task(_reap_idle_turns(tracker, metrics))
        watcher = asyncio.create_task(routing_watch.run()) if routing_watch is not None else None
        try:
            yield
        finally:
            reaper.cancel()
            if watcher is not None:
                watcher.cancel()
            tracker.close_all("shutdown")
            if settings.watch_policy and policy is not None:
                policy.stop_watching()
            await runner.aclose()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(
        title="openalice-runner",
        version=_version(),
        lifespan=lifespan,
        # FastAPI's built-in OpenTelemetry: keep its HTTP SERVER span per request (it continues a
        # traceparent); drop its per-dependency spans (noise) and its exception logs (we log ourselves).
        telemetry={
            "tracer_provider": tracer_provider,
            "meter_provider": meter_provider,
            "operation_spans": False,
            "logs": False,
            # A scrape a second would bury the agent's spans.
            "exclude": lambda scope: scope.get("path") in ("/health", "/metrics"),
        },
    )
    app.state.runner, app.state.tracker, app.state.metrics = runner, tracker, metrics
    install_error_handlers(app)
    app.state.drain = Drain()  # set by DrainingServer on SIGTERM (server/connections.py)
    app.add_middleware(
        GuardMiddleware,
        drain=app.state.drain,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        public_paths=PUBLIC_PATHS | {"/metrics"} if settings.metrics_public else PUBLIC_PATHS,
    )

    @app.post("/v1/chat/completions", openapi_extra=_CHAT_BODY_DOC)
    async def chat_completions(request: Request) -> Response:
        body = await read_chat_request(request)  # parsed and validated off the loop (server/body.py)
        tc = turn_context(request.headers, body.metadata)
        deadline = request_deadline(request.headers, body.timeout, settings.request_timeout_s)
        await anyio.to_thread.run_sync(lambda: check_request(body, max_tokens_limit=settings.max_tokens_limit))
        refused = _refusal(tc.turn_type, body.model)
        if refused is not None:  # every provider of the route is full: 429 before any work
            labels = {"turn_type": bounds.turn_type(tc.turn_type), "stream": str(body.stream).lower()}
            metrics.chat_completions.labels(**labels, outcome="refused").inc()
            raise api_error_from(refused)
        step = tracker.begin(
            conversation_id=tc.conversation_id,
            turn_type=tc.turn_type,
            agent=tc.agent,
            parent=_turn_parent(request, tracked=tc.conversation_id is not None),
            messages=body.messages,
            step=tc.step,
        )
        metrics.open_turns.set(len(tracker))
        ctx = CallContext(
            conversation_id=tc.conversation_id,
            turn_type=tc.turn_type,
            step=step.step,
            agent=tc.agent,
            model=body.model,
            attributes={OTEL_CONTEXT_KEY: step.turn.context},
        )
        span_ctx = step.turn.span.get_span_context()
        request.state.trace_ids = (format(span_ctx.trace_id, "032x"), format(span_ctx.span_id, "016x"))
        if body.stream:
            return await _stream(body, ctx, step, deadline, request)
        return await _complete(body, ctx, step, deadline, request)

    def _refusal(turn_type: str, model: str | None) -> Exception | None:
        try:
            return runner.refusal(turn_type, model)
        except LookupError as exc:
            error = _map_error(exc)
            if error.code == "model_not_found":  # no route takes the name: 404 before any work
                raise error from None
            return None  # any other "no route": runner.chat says so in its own words

    def _failed(step: Step, labels: dict[str, str], exc: BaseException) -> None:
        tracker.finish(step, error=exc)
        metrics.chat_completions.labels(**labels, outcome=_outcome(exc)).inc()
        reason = _cancel_reason(exc)
        if reason is not None:
            metrics.cancelled.labels(reason=reason).inc()

    async def _complete(
        body: ServerChatRequest, ctx: CallContext, step: Step, deadline: Deadline, request: Request
    ) -> Response:
        labels = {"turn_type": bounds.turn_type(ctx.turn_type), "stream": "false"}
        metrics.in_flight.inc()
        try:
            with trace.use_span(
                step.turn.span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                # Raced against the deadline and the client leaving: either stops the generation.
                result = await race(runner.chat(body, ctx), deadline, request.receive)
        except ClientGone as exc:
            _failed(step, labels, exc)
            return Response(status_code=499)  # nobody reads it; the access log shows what happened
        except BaseException as exc:
            _failed(step, labels, exc)
            if not isinstance(exc, Exception):
                raise  # cancellation and exits propagate as themselves
            raise api_error_from(exc) from exc
        finally:
            metrics.in_flight.dec()
            metrics.open_turns.set(len(tracker))
        tracker.finish(
            step,
            finish_reason=result.finish_reason,
            tool_calls=[(call.id, call.function.name) for call in result.tool_calls],
        )
        metrics.open_turns.set(len(tracker))
        metrics.chat_completions.labels(**labels, outcome="ok").inc()
        metrics.tokens.labels(type="input").inc(result.usage.prompt_tokens)
        metrics.tokens.labels(type="output").inc(result.usage.completion_tokens)
        return JSONResponse(result.to_openai())

    async def _stream(
        body: ServerChatRequest, ctx: CallContext, step: Step, deadline: Deadline, request: Request
    ) -> Response:
        labels = {"turn_type": bounds.turn_type(ctx.turn_type), "stream": "true"}
        t0 = time.perf_counter()
        metrics.in_flight.inc()
        opened = runner.stream(body, ctx)
        try:
            # The stream is opened (a slot taken) and its first chunk awaited before answering, so a
            # failure up to here is a real HTTP status; the stream is closed again when it fails.
            chunks, first = await race(_open_first(opened), deadline, request.receive)
        except BaseException as exc:
            metrics.in_flight.dec()
            _failed(step, labels, exc)
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            if not isinstance(exc, Exception):
                raise
            raise api_error_from(exc) from exc
        stream = SSEStream(
            first=first,
            opened=opened,
            chunks=chunks,
            step=step,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            turn_type=labels["turn_type"],  # the stream's metric label
            t0=t0,
            tracker=tracker,
            metrics=metrics,
            to_api_error=api_error_from,
            deadline=deadline,
        )
        return GuardedStreamingResponse(stream, headers={"Cache-Control": "no-cache"})

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [_model_object(name, created) for name in runner.model_names()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id not in runner.model_names():
            raise APIError(
                404, f"model {model_id!r} is not served here (GET /v1/models lists the models)",
                param="model", code="model_not_found", type="invalid_request_error",
            )  # fmt: skip
        return _model_object(model_id, int(time.time()))

    @app.get("/v1/policy")
    async def policy_in_force() -> dict[str, Any]:
        store = runner.policy
        if store is None:
            raise APIError(404, "no policy is configured", code="no_policy")
        return _policy_view(store)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        store = runner.policy
        full = authenticated(request.headers.get("authorization"), settings.api_key)
        out = {
            "status": "ok",
            "models": runner.model_names(),
            "policy_version": getattr(store, "version", None),
            "open_turns": len(tracker),
        }
        source = getattr(store, "path", None)
        if source is not None:  # a rejected edit shows here, as the providers file's does
            out["policy"] = file_status(source, getattr(store, "last_error", None), full=full)
        if routing_watch is not None:
            watched = routing_watch.status()
            out["providers"] = file_status(watched["source"], watched.get("last_error"), full=full,
                                           needs_restart=watched.get("needs_restart"))  # fmt: skip
        return out

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        # Rendering walks every series: off the event loop, so a scrape never stalls requests.
        text = await anyio.to_thread.run_sync(metrics.scrape, settings.metrics_max_age_s)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    _with_chat_schemas(app)
    return app


# The body is read by read_chat_request, not by FastAPI; the OpenAPI document still shows its schema.
_CHAT_SCHEMA = ServerChatRequest.model_json_schema(ref_template="#/components/schemas/{model}")
_CHAT_DEFS = _CHAT_SCHEMA.pop("$defs", {})
_CHAT_BODY_DOC = {"requestBody": {"required": True, "content": {"application/json": {"schema": _CHAT_SCHEMA}}}}


def _with_chat_schemas(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        doc = generate()
        doc.setdefault("components", {}).setdefault("schemas", {}).update(_CHAT_DEFS)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "openalice-runner"}


def api_error_from(exc: BaseException) -> APIError:
    error = _map_error(exc)
    if error.status_code >= 500 and error.code == "internal_error":
        ERRORS.report("request failed", exc)  # one line, the traceback once per distinct error
    return error


def _turn_parent(request: Request, *, tracked: bool) -> Any:
    """Parent of a new turn span: the request's HTTP server span where there is one (it continues the
    caller's traceparent), so the two share a trace. A conversation's turn outlives the request that
    opens it and stays a child of that request's server span. Without a server span: the caller's
    span (traceparent), or a trace of its own."""
    from opentelemetry import context as otel_context

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
    span = getattr(request.scope.get("fastapi.telemetry"), "span", None)
    if span is None or not span.get_span_context().is_valid:
        return None
    return span


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, ClientGone | asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    error = _map_error(exc) if isinstance(exc, Exception) else None
    return "refused" if error is not None and error.status_code == 429 else "error"


def _cancel_reason(exc: BaseException) -> str | None:
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, ClientGone | asyncio.CancelledError | GeneratorExit):
        return "client_gone"
    return None


async def _open_first(
    opened: AbstractAsyncContextManager[ChatStream],
) -> tuple[ChatStream, ChatChunk | None]:
    """Enter the stream's context and read its first chunk (None: the stream is empty). On failure or
    cancellation the context is left at once, with the error, so the generation stops here."""
    chunks = await opened.__aenter__()
    try:
        return chunks, await anext(chunks, None)  # StopAsyncIteration cannot leave a task as itself
    except BaseException as exc:
        try:
            await opened.__aexit__(type(exc), exc, exc.__traceback__)
        except Exception:  # already failed; the first error is what counts
            log.debug("closing a failed stream failed", exc_info=True)
        raise


def _policy_view(store: Any) -> dict[str, Any]:
    policy = getattr(store, "policy", None)
    view: dict[str, Any] = {
        "version": getattr(store, "version", None),
        "source": str(getattr(store, "source", None) or getattr(store, "path", None) or ""),
        "policy": policy.model_dump(mode="json") if hasattr(policy, "model_dump") else policy,
    }
    # A broken edit keeps the last good policy in force; say so when the store knows.
    for key in ("last_error", "last_reload_error"):
        value = getattr(store, key, None)
        if value is not None:
            view["last_error"] = str(value)
            break
    return view


class _ConfiguredTurnTypes:
    """The turn types the policy's rules and the routes name (recomputed when either changes)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._key: tuple[Any, int] | None = None
        self._names: frozenset[str] = frozenset()

    def __call__(self) -> frozenset[str]:
        store = getattr(self.runner, "policy", None)
        routing = getattr(self.runner, "routing", None)
        key = (getattr(store, "version", None), id(routing))
        if key != self._key:
            names: set[str] = set()
            for rule in getattr(getattr(store, "policy", None), "rules", None) or ():
                value = getattr(getattr(rule, "match", None), "turn_type", None)
                names.update([value] if isinstance(value, str) else value or ())
            for route in getattr(routing, "routes", None) or ():
                names.update(route.match.turn_types or ())
            self._key, self._names = key, frozenset(names)
        return self._names


async def _reap_idle_turns(tracker: TurnTracker, metrics: ServerMetrics) -> None:
    interval = max(1.0, min(30.0, tracker.idle_timeout_s / 4))
    while True:
        await asyncio.sleep(interval)
        tracker.reap_idle()
        metrics.open_turns.set(len(tracker))


def _version() -> str:
    from openalice_runner import __version__

    return __version__

"""The sidecar: an OpenAI-compatible HTTP API over a Runner, wired together here.

Routes: POST /v1/chat/completions (OpenAI Chat Completions), POST /v1/messages (Anthropic Messages;
POST /v1/messages/count_tokens beside it) and POST /v1/responses (OpenAI Responses,
server/wires/responses/), plain and SSE, each wire a translation
(server/wires/) onto one request path (server/pipeline.py); GET /v1/models, GET /v1/policy, GET /health,
GET /metrics (server/read_only.py); startup and shutdown: server/lifespan.py.
Every request of a conversation lands in its agent turn (server/turns.py), so the trace shows the turn's
model calls and the tool steps between them under one `invoke_agent` span.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from openalice_runner.redaction import register_secret
from openalice_runner.server.chat_schema import (
    CHAT_BODY_DOC,
    COUNT_TOKENS_BODY_DOC,
    MESSAGES_BODY_DOC,
    with_chat_schemas,
)
from openalice_runner.server.connections import Drain
from openalice_runner.server.errors import install_error_handlers
from openalice_runner.server.guard import PUBLIC_PATHS, GuardMiddleware, RouteNames
from openalice_runner.server.lifespan import ServingLifespan
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.pipeline import RequestPipeline
from openalice_runner.server.read_only import ReadOnlyEndpoints
from openalice_runner.server.routing_watch import RoutingWatcher
from openalice_runner.server.runner_protocol import ServedRunner
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.tenants.keys_file import load_keys_file
from openalice_runner.server.tenants.registry import RateLimiter, TenantKeys
from openalice_runner.server.tenants.watch import KeysWatcher
from openalice_runner.server.turn_types import ConfiguredTurnTypes
from openalice_runner.server.turns import TurnTracker
from openalice_runner.server.wires import CHAT, MESSAGES
from openalice_runner.server.wires.messages import CountTokens
from openalice_runner.server.wires.responses.openapi import RESPONSES_BODY_DOC, with_responses_schemas
from openalice_runner.server.wires.responses.wire import ResponsesWire
from openalice_runner.tracing.labels import LabelBounds
from openalice_runner.tracing.redacting import RedactingTracerProvider
from openalice_runner.tracing.telemetry import RunnerTelemetry

__all__ = ["ServerSettings", "create_app"]


def create_app(
    runner: ServedRunner,
    *,
    telemetry: RunnerTelemetry | None = None,
    settings: ServerSettings | None = None,
    metrics: ServerMetrics | None = None,
    on_shutdown: Callable[[], Any] | None = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
) -> FastAPI:
    """`runner`: a Runner (server/runner_protocol.py says what of it is used). `on_shutdown`: callable run last
    (the CLI flushes the trace exporters there). `tracer_provider`/`meter_provider`: for FastAPI's own
    HTTP server spans and metrics (None: the global ones)."""
    settings = settings or ServerSettings()
    tenants, limiter, keys_watch = _tenants(settings)  # first: a keys file that cannot be used stops here
    telemetry = telemetry or RunnerTelemetry()
    metrics = metrics or ServerMetrics()
    metrics.track_runner(runner)
    # Turn types a client sends become metric labels only when configured (policy, routes) or standard.
    bounds = LabelBounds(turn_types=ConfiguredTurnTypes(runner))
    telemetry.label_bounds = bounds
    register_secret(settings.api_key)
    tracker = TurnTracker(
        telemetry, max_open=settings.max_open_turns, idle_timeout_s=settings.turn_idle_timeout_s
    )
    watch = (  # the providers file, applied live when an edit validates
        RoutingWatcher(runner, settings.providers_file, settings.watch_interval_s)
        if settings.providers_file
        else None
    )
    lifespan = ServingLifespan(
        runner,
        settings=settings,
        tracker=tracker,
        metrics=metrics,
        routing_watch=watch,
        on_shutdown=on_shutdown,
        keys_watch=keys_watch,
    )
    routes = RouteNames()  # request paths as bounded names: labels, the access log, the server span
    app = FastAPI(
        title="openalice-runner",
        version=_version(),
        lifespan=lifespan.run,
        # FastAPI's built-in OpenTelemetry: keep its HTTP SERVER span per request (it continues a
        # traceparent); drop its per-dependency spans (noise) and its exception logs (we log ourselves).
        telemetry={
            # its span's url.path and url.query as the client sent them could carry a key: redacted
            "tracer_provider": RedactingTracerProvider(tracer_provider, routes.redact_span),
            "meter_provider": meter_provider,
            "operation_spans": False,
            "logs": False,
            # A scrape a second would bury the agent's spans.
            "exclude": lambda scope: scope.get("path") in ("/health", "/metrics"),
        },
    )
    app.state.runner, app.state.tracker, app.state.metrics = runner, tracker, metrics
    app.state.keys_watch, app.state.tenant_limiter = keys_watch, limiter
    install_error_handlers(app)
    app.state.drain = Drain()  # set by DrainingServer on SIGTERM (server/connections.py)
    app.add_middleware(
        GuardMiddleware,
        drain=app.state.drain,
        api_key=settings.api_key,
        tenants=tenants,
        limiter=limiter,
        bounds=bounds,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        public_paths=PUBLIC_PATHS | {"/metrics"} if settings.metrics_public else PUBLIC_PATHS,
        routes=routes,
    )
    pipeline = RequestPipeline(runner, settings=settings, tracker=tracker, metrics=metrics, bounds=bounds)
    app.post("/v1/chat/completions", openapi_extra=CHAT_BODY_DOC)(pipeline.handler(CHAT))
    app.post("/v1/messages", openapi_extra=MESSAGES_BODY_DOC)(pipeline.handler(MESSAGES))
    count_tokens = CountTokens(runner, settings)
    app.post("/v1/messages/count_tokens", openapi_extra=COUNT_TOKENS_BODY_DOC)(count_tokens.handle)
    # its own store of recent responses (previous_response_id), one per app
    app.post("/v1/responses", openapi_extra=RESPONSES_BODY_DOC)(pipeline.handler(ResponsesWire()))
    read_only = ReadOnlyEndpoints(
        runner, settings=settings, tracker=tracker, metrics=metrics, routing_watch=watch, keys_watch=keys_watch
    )
    read_only.add_to(app)
    with_chat_schemas(app)
    with_responses_schemas(app)
    routes.learn(app.routes)
    return app


def _tenants(settings: ServerSettings) -> tuple[TenantKeys | None, RateLimiter, KeysWatcher | None]:
    """The keys in force, the tenants' rate limits and the keys file's watcher: from `keys_file`
    (KeysFileError at FILE:LINE:COL when it cannot be used), else `api_key` as the one tenant "default",
    else none (an open server)."""
    limiter = RateLimiter()
    if settings.keys_file is None:
        return (TenantKeys.single(settings.api_key) if settings.api_key else None), limiter, None
    if settings.api_key:
        raise ValueError("an API key and a keys file together: give the key a tenant in the keys file "
                         "(`openalice-runner keys hash` prints its hash) and drop --api-key / $OPENALICE_API_KEY")
    keys = TenantKeys(load_keys_file(settings.keys_file))
    return keys, limiter, KeysWatcher(keys, limiter, settings.keys_file, settings.watch_interval_s)


def _version() -> str:
    from openalice_runner import __version__

    return __version__

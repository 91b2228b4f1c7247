"""GuardMiddleware: API key (and the tenant it names), the tenant's rate limit, body size limit, access
log and HTTP metrics, before any route runs.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched and cancellation
reaches the route when a client disconnects.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

import structlog
from fastapi import HTTPException

from openalice_runner.server.error_log import ERRORS, REQUEST_ID
from openalice_runner.server.errors import APIError
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.tenants.registry import RateLimiter, TenantKeys, retry_after_header
from openalice_runner.server.tenants.tenant import Tenant
from openalice_runner.server.wires import error_parts, wire_for_path
from openalice_runner.tracing.labels import LabelBounds

log = structlog.get_logger("openalice_runner.server.access")

# Open without a key: liveness carries no secrets, and probes rarely hold tokens. /metrics joins it
# with `serve --metrics-public` (it names models, providers and load, so it is keyed by default).
PUBLIC_PATHS = frozenset({"/health"})
# Routes as metric labels; anything else is "other" so clients cannot mint label values.
KNOWN_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/models",
     "/v1/policy", "/health", "/metrics"}
)  # fmt: skip


_MODEL_ROUTE = "/v1/models/{id}"


class RouteNames:
    """A request path as a bounded name (metric label, access log, span attribute): a static route's
    path as is, a templated one's template, anything else "other". Never the raw path: a client
    chooses it (`/v1/models/KEY`), and labels and traces keep what they are given. `learn` adds the
    app's routes once they are all registered, so routes added by other modules are named too."""

    def __init__(self) -> None:
        self.static: set[str] = set(KNOWN_ROUTES)
        self.prefixes: list[tuple[str, str]] = [("/v1/models/", _MODEL_ROUTE)]

    def learn(self, routes: Any) -> None:
        for route in routes:
            path = getattr(route, "path", None)
            if not isinstance(path, str):
                continue
            if "{" not in path:
                self.static.add(path)
            elif not any(path.startswith(prefix) for prefix, _ in self.prefixes):
                self.prefixes.append((path.split("{", 1)[0], path.split(":", 1)[0].rstrip("}") + "}"))

    def __call__(self, path: str) -> str:
        if path in self.static:
            return path
        for prefix, template in self.prefixes:
            if path.startswith(prefix) and len(path) > len(prefix):
                return template
        return "other"

    def redact_span(self, attributes: dict[str, Any]) -> dict[str, Any]:
        """Server span attributes without what a client could have put a secret in: the query string
        goes, the path becomes its route's name."""
        attributes.pop("url.query", None)
        path = attributes.get("url.path")
        if isinstance(path, str):
            attributes["url.path"] = self(path)
        return attributes


# HTTP methods as metric labels; h11 takes any token as a method, so others are "other" too.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _too_large(limit: int) -> str:
    return f"request body exceeds {limit} bytes"


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, _too_large(limit), code="body_too_large")


class GuardMiddleware:
    def __init__(
        self,
        app: Any,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: ServerMetrics,
        public_paths: frozenset[str] = PUBLIC_PATHS,
        drain: Any = None,
        routes: RouteNames | None = None,
        tenants: TenantKeys | None = None,
        limiter: RateLimiter | None = None,
        bounds: LabelBounds | None = None,
    ) -> None:
        """`tenants`: the keys in force (`serve --keys`, hot-reloaded); without it `api_key` is the one
        key (tenant "default"); with neither, the server is open and requests have no tenant."""
        self.app = app
        self.routes = routes or RouteNames()
        self.drain = drain  # server/connections.py Drain: after SIGTERM, new requests get 503
        self.public_paths = public_paths
        self.tenants = tenants if tenants is not None else TenantKeys.single(api_key) if api_key else None
        self.limiter = limiter or RateLimiter()
        self.bounds = bounds or LabelBounds()  # tenant names as metric labels
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = self.routes(path)
        t0 = time.perf_counter()
        status_holder = {"status": 500}
        response = _ResponseState()
        scope.setdefault("state", {})  # request.state: the tenant, the trace ids
        extra: dict[str, Any] = {}
        request_id = secrets.token_hex(8)  # in the access log, error lines and X-Request-Id
        REQUEST_ID.set(request_id)

        async def send_wrapper(message: dict) -> None:
            response.note(message)
            if message["type"] == "http.response.start":
                status_holder["status"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        admitted = False
        try:
            if self.drain is not None and self.drain.draining:
                await _send_error(send_wrapper, DRAINING, path)
                return
            error = self._check(scope, path)
            if error is not None:
                await _send_error(send_wrapper, error, path)
                return
            if self.drain is not None:
                self.drain.in_flight += 1
                admitted = True
            await self.app(scope, self._limited(receive), send_wrapper)
        except Exception as exc:
            # Starlette's error middleware answers (our handler logs it, rate-limited) and then
            # re-raises, for uvicorn to log the whole traceback again, per request: end it here.
            if not response.started:
                ERRORS.report("unhandled error", exc, path=route)
                await _send_error(send_wrapper, APIError(500, "internal error", code="internal_error"), path)
        except asyncio.CancelledError:
            # uvicorn cancels what still runs past --shutdown-grace. Answer in OpenAI's terms rather
            # than leave uvicorn's text/plain 500 or a stream that just stops; the request ends here.
            if response.complete:
                raise
            await _send_cut(send, response, path)
            extra = {"cut": "shutdown", "status_sent": status_holder["status"]} if response.started else {}
            status_holder["status"] = 503
        finally:
            if admitted:
                self.drain.in_flight -= 1
            self._account(scope, route, status_holder["status"], time.perf_counter() - t0, request_id, extra)

    def _account(
        self, scope: dict, route: str, status: int, elapsed: float, request_id: str, extra: dict[str, Any]
    ) -> None:
        """A finished request's metrics (by tenant where there is one) and its access-log line."""
        state = scope["state"]
        method = scope.get("method", "")
        tenant = state.get("tenant")
        if tenant is not None:
            self.metrics.tenant_requests.labels(tenant=self.bounds.tenant(tenant.name), status=str(status)).inc()
            extra["tenant"] = tenant.name
        self.metrics.http_requests.labels(
            route=route, method=method if method in KNOWN_METHODS else "other", status=str(status)
        ).inc()
        self.metrics.http_duration.labels(route=route).observe(elapsed)
        ids = state.get("trace_ids")
        if ids:
            extra.update(trace_id=ids[0], span_id=ids[1])
        log.info(
            "request",
            request_id=request_id,
            method=scope.get("method"),
            path=route,
            status=status,
            duration_ms=round(elapsed * 1000, 2),
            **extra,
        )

    def _check(self, scope: dict, path: str) -> APIError | None:
        headers = _headers(scope)
        if self.tenants is not None and path not in self.public_paths:
            tenant = self._tenant(headers)
            if tenant is None:
                return APIError(
                    401,
                    "missing or invalid API key (send Authorization: Bearer <key>, or x-api-key: <key>)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            scope["state"]["tenant"] = tenant  # request.state.tenant: the pipeline reads it
            wait = self.limiter.check(tenant)
            if wait is not None:
                return APIError(
                    429,
                    f"rate limit of {tenant.requests_per_minute} requests per minute reached for this key; "
                    "retry after the Retry-After header's seconds",
                    code="rate_limit_exceeded",
                    headers=retry_after_header(wait),
                )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.max_body_bytes:
                    return BodyTooLarge(self.max_body_bytes)
            except ValueError:
                return APIError(400, "invalid Content-Length header", code="invalid_header")
        return None

    def _tenant(self, headers: dict[bytes, bytes]) -> Tenant | None:
        """The tenant of the key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's
        (x-api-key): every header that is sent must name the same tenant, so a wrong key is never
        outvoted by a right one."""
        sent: list[bytes] = []
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, token = auth.partition(b" ")
            sent.append(token.strip() if scheme.lower() == b"bearer" else b"")
        if b"x-api-key" in headers:
            sent.append(headers[b"x-api-key"].strip())
        assert self.tenants is not None
        # Hashes compared in constant time (TenantKeys.find): the time taken tells nothing of a guess.
        found = [self.tenants.find(token) if token else None for token in sent]
        if not found or any(t is None or t is not found[0] for t in found):
            return None
        return found[0]

    def _limited(self, receive: Any) -> Any:
        """Counts body bytes as they arrive (chunked bodies carry no Content-Length)."""
        limit = self.max_body_bytes
        seen = 0

        async def receive_limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # FastAPI re-raises HTTPException from body reading as is (others become a 400).
                    raise HTTPException(413, _too_large(limit))
            return message

        return receive_limited


class _ResponseState:
    """What of the response has gone out: its start (and whether it is SSE), and its end."""

    def __init__(self) -> None:
        self.started = self.sse = self.complete = False

    def note(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in message.get("headers", ())
            )
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True


SHUTTING_DOWN = APIError(
    503,
    "the server is shutting down and stopped this request before it was complete; retry",
    code="server_shutting_down",
    headers={"Retry-After": "1"},
)


DRAINING = APIError(
    503,
    "the server is shutting down and takes no new requests; retry (another replica, or this one once restarted)",
    code="server_shutting_down",
    headers={"Retry-After": "1", "Connection": "close"},
)


async def _send_cut(send: Any, response: _ResponseState, path: str) -> None:
    """503 for a request whose answer has not started; an error event ends a stream that has."""
    try:
        if not response.started:
            await _send_error(send, SHUTTING_DOWN, path)
        elif response.sse:
            event = wire_for_path(path).stream_error(SHUTTING_DOWN)
            await send({"type": "http.response.body", "body": event, "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except Exception:  # the client may be gone already; nothing more to tell it
        log.debug("answering a request cut by shutdown failed", exc_info=True)


def _headers(scope: dict) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers", [])}


async def _send_error(send: Any, error: APIError, path: str) -> None:
    """`error` in the shape of the wire whose route was asked (server/wires/)."""
    status, data, extra = error_parts(path, error)
    body = json.dumps(data).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    for key, value in extra.items():
        headers.append((key.lower().encode(), value.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

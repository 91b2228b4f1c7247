"""GuardMiddleware: API key, body size limit, access log and HTTP metrics, before any route runs.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses pass through untouched and cancellation
reaches the route when a client disconnects.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from typing import Any

import structlog
from fastapi import HTTPException

from openalice_runner.server.error_log import ERRORS, REQUEST_ID
from openalice_runner.server.errors import APIError
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.wires import error_parts, wire_for_path

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
    ) -> None:
        self.app = app
        self.drain = drain  # server/connections.py Drain: after SIGTERM, new requests get 503
        self.public_paths = public_paths
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in KNOWN_ROUTES else _MODEL_ROUTE if path.startswith("/v1/models/") else "other"
        t0 = time.perf_counter()
        status_holder = {"status": 500}
        response = _ResponseState()
        state = scope.setdefault("state", {})
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
            status = status_holder["status"]
            elapsed = time.perf_counter() - t0
            method = scope.get("method", "")
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
        if self.api_key is not None and path not in self.public_paths and not self._key_matches(headers):
            return APIError(
                401,
                "missing or invalid API key (send Authorization: Bearer <key>, or x-api-key: <key>)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.max_body_bytes:
                    return BodyTooLarge(self.max_body_bytes)
            except ValueError:
                return APIError(400, "invalid Content-Length header", code="invalid_header")
        return None

    def _key_matches(self, headers: dict[bytes, bytes]) -> bool:
        """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key): either
        header that is sent must hold it, so a wrong one is never outvoted by a right one."""
        sent: list[bytes] = []
        auth = headers.get(b"authorization")
        if auth is not None:
            scheme, _, token = auth.partition(b" ")
            sent.append(token.strip() if scheme.lower() == b"bearer" else b"")
        if b"x-api-key" in headers:
            sent.append(headers[b"x-api-key"].strip())
        assert self.api_key is not None
        # Constant-time compare: the time taken must not tell how much of a guess was right.
        return bool(sent) and all([hmac.compare_digest(token, self.api_key) for token in sent])

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

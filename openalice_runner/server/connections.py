"""Connection guards below the app: deadlines for the request head and body, a cap on open
connections with a slice kept for /health and /metrics, OpenAI-shaped answers to what h11 cannot
parse, and a drain after SIGTERM.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but gives a client that sends its
request head slowly as long as it likes, before any route (or API key check) runs: a probe held
1,000 connections open for a minute sending one header byte a second. This h11 protocol closes a
connection whose head has not arrived `header_timeout_s` after the connection opened or after the
previous response, and answers 503 at once to a connection past `max_connections` (uvicorn's own
`limit_concurrency` only answers once the head is in, which a slow client never sends).

After the head, the body must arrive within `body_timeout_s` and, past `body_grace_s`, at no less
than `min_body_rate` bytes a second (600 clients sending one body byte a second held every
connection for as long as they liked); a slow one gets 408 and is closed. Past `max_connections`,
`reserved_connections` more are let in for /health and /metrics only (a probe or scraper still gets
an answer when clients hold every ordinary slot); past both, 503 at once.

Every answer sent before cutting a connection (408, 400, 503) closes it lingeringly, as nginx does:
the answer, then our half of the connection (FIN), then what the client still sends is read and
dropped until it closes its half or `linger_s` passes. Closed at once, a client still uploading
got a reset (the kernel's answer to data for a closed socket), which can discard the answer
unread or fail the client's next write before it reads.

`DrainingServer`: on SIGTERM (and SIGHUP) the listening socket stays open while requests in flight
finish (up to the shutdown grace) and every new request gets 503 JSON with Retry-After, instead of a
refused connection; then uvicorn's own shutdown closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import Generator
from typing import Any

import structlog
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from openalice_runner.server.streaming import ABORT_KEY

log = structlog.get_logger("openalice_runner.server")


def _raw_response(status: str, body: dict[str, Any] | None, extra: str = "") -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
        f"connection: close\r\n{extra}\r\n"
    )
    return head.encode() + data


_BUSY = _raw_response(
    "503 Service Unavailable",
    {"error": {"message": "too many open connections; retry later", "type": "service_unavailable_error",
               "param": None, "code": "too_many_connections"}},
    "retry-after: 1\r\n",
)  # fmt: skip
_HEAD_TIMEOUT = _raw_response(
    "408 Request Timeout",
    {"error": {"message": "the request head did not arrive in time", "type": "timeout_error",
               "param": None, "code": "header_timeout"}},
)  # fmt: skip


_BODY_TIMEOUT = _raw_response(
    "408 Request Timeout",
    {"error": {"message": "the request body did not arrive in time (too slow after the head)",
               "type": "timeout_error", "param": None, "code": "body_timeout"}},
)  # fmt: skip
_BAD_HTTP = _raw_response(
    "400 Bad Request",
    {"error": {"message": "the request is not valid HTTP/1.1 (a malformed request line or header, e.g. "
               "a Content-Length that is not a number)", "type": "invalid_request_error", "param": None,
               "code": "invalid_http"}},
)  # fmt: skip
# Answered on a connection of the reserved slice (past max_connections).
RESERVED_PATHS = frozenset({"/health", "/metrics"})
_BUSY_BODY = json.loads(_BUSY.split(b"\r\n\r\n", 1)[1])


def _reserved_only(app: Any) -> Any:
    """`app` for /health and /metrics; anything else is 503 too_many_connections."""

    async def reserved(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in RESERVED_PATHS:
            await app(scope, receive, send)
            return
        body = json.dumps(_BUSY_BODY).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"retry-after", b"1"), (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return reserved


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0
    max_connections: int | None = None
    reserved_connections: int = 0
    body_timeout_s: float = 30.0
    body_grace_s: float = 5.0
    min_body_rate: float = 1024.0  # bytes per second, after body_grace_s
    linger_s: float = 2.0  # after an answer we cut with: the bound on reading what the client still sends

    # as uvicorn's own: asyncio.Protocol's stub takes a BaseTransport, an HTTP protocol needs a Transport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False
        self._waiting_after: Any = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_cycle: Any = None
        self._body_bytes = 0
        self._body_t0 = 0.0
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None
        if self.max_connections is not None:
            open_now = len(self.connections)
            if open_now > self.max_connections + self.reserved_connections:
                log.warning("connection refused: too many open", limit=self.max_connections)
                self._answer_and_close(_BUSY)
                return
            if open_now > self.max_connections:
                self.app = _reserved_only(self.app)  # this connection may ask for /health and /metrics only
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # answered and cut: read only to be dropped (see _answer_and_close)
        if self._head_timer is not None:
            self._head_started = True
        if self._body_timer is not None:
            self._body_bytes += len(data)
        super().data_received(data)
        if self._lingering:
            return  # h11 could not parse it: answered 400 and cut
        cycle = self.cycle
        if cycle is not None and ABORT_KEY not in cycle.scope:  # a new request: how to cut its connection
            cycle.scope[ABORT_KEY] = self.transport.abort  # type: ignore[literal-required]  # our own key
        if self._head_timer is not None and self.cycle is not self._waiting_after:
            self._disarm_head_timer()  # a new request's head is in: its route runs now
        cycle = self.cycle
        if cycle is not None and cycle is not self._body_cycle and cycle.more_body and not cycle.response_started:
            self._watch_body(cycle)  # a head is in and its body is still to come

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot parse (e.g. `Content-Length: abc`) gets OpenAI's error shape, not text/plain."""
        log.info("connection closed: invalid HTTP", detail=msg)
        self._answer_and_close(_BAD_HTTP)

    # ---- the body's deadline and rate

    def _watch_body(self, cycle: Any) -> None:
        self._disarm_body_timer()
        self._body_cycle = cycle
        self._body_bytes = 0
        self._body_t0 = self.loop.time()
        self._body_timer = self.loop.call_later(self._body_check_every(), self._check_body)

    def _body_check_every(self) -> float:
        return max(0.05, min(1.0, self.body_timeout_s / 4, self.body_grace_s / 2 or 1.0))

    def _disarm_body_timer(self) -> None:
        timer = getattr(self, "_body_timer", None)
        if timer is not None:
            timer.cancel()
            self._body_timer = None

    def _check_body(self) -> None:
        self._body_timer = None
        cycle = self._body_cycle
        if self._cut() or cycle is not self.cycle or not cycle.more_body or cycle.response_started:
            return  # the body is in (or the app answered without it)
        elapsed = self.loop.time() - self._body_t0
        if self.flow.read_paused:  # the app is not reading: not the client's fault
            self._body_t0 += self._body_check_every()
        elif elapsed >= self.body_timeout_s or (
            elapsed >= self.body_grace_s and self._body_bytes < self.min_body_rate * elapsed
        ):
            log.info("connection closed: request body too slow", received=self._body_bytes,
                     seconds=round(elapsed, 2), timeout_s=self.body_timeout_s, min_rate=self.min_body_rate)  # fmt: skip
            self._answer_and_close(_BODY_TIMEOUT)
            return
        self._body_timer = self.loop.call_later(self._body_check_every(), self._check_body)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request on this connection must bring its head in time too (unless a pipelined
        # one already started, or the connection is closing).
        if not self._cut() and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    # ---- cutting a connection with an answer

    def _cut(self) -> bool:
        return self._lingering or self.transport.is_closing()

    def _answer_and_close(self, answer: bytes) -> None:
        """`answer`, our FIN, then a lingering close: what the client still sends (the rest of a body
        it is uploading) is read and dropped, so the kernel has no unread data to answer with a reset,
        until the client closes its half (the transport closes at that EOF) or `linger_s` passes."""
        self._disarm_head_timer()
        self._disarm_body_timer()
        self._lingering = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # the app's request is over now: its receive() says so, its sends go nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        transport = self.transport
        transport.write(answer)
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()  # sent once the answer is out
        if not transport.is_reading():  # h11 paused it (a pipelined request): the drain must read
            transport.resume_reading()
        self._linger_timer = self.loop.call_later(self.linger_s, transport.close)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_started = False
        self._waiting_after = self.cycle
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._cut():
            return
        # A partial head gets a 408 saying why; an idle connection just closes (a 408 nobody asked
        # for could be read as the answer to the client's next request).
        if self._head_started:
            log.info("connection closed: request head too slow", timeout_s=self.header_timeout_s)
            self._answer_and_close(_HEAD_TIMEOUT)
        else:
            self.transport.close()


def guarded_h11(
    header_timeout_s: float,
    max_connections: int | None,
    *,
    reserved_connections: int = 0,
    body_timeout_s: float = 30.0,
    body_grace_s: float = 5.0,
    min_body_rate: float = 1024.0,
) -> type[GuardedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these limits."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections,
         "reserved_connections": reserved_connections, "body_timeout_s": body_timeout_s,
         "body_grace_s": min(body_grace_s, body_timeout_s), "min_body_rate": min_body_rate},
    )  # fmt: skip


class Drain:
    """Whether the server is draining (SIGTERM came): GuardMiddleware answers new requests 503."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0  # requests admitted and not yet answered (the drain waits for these)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining first on shutdown: the socket stays open and new requests get
    503 + Retry-After while those in flight finish, up to the graceful-shutdown timeout.

    SIGHUP (the terminal or session going away, or a supervisor's "reload") drains as SIGTERM does;
    left to its default it killed the process at once: streams cut without an error event, queued
    requests unanswered, spans not written. It is not re-raised after the drain (uvicorn re-raises
    the signals it handled), so the process goes on to flush and exit 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        hangup = getattr(signal, "SIGHUP", None)
        if hangup is None or threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        previous = signal.signal(hangup, self._hang_up)
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(hangup, previous)

    def _hang_up(self, sig: int, frame: Any) -> None:
        log.info("SIGHUP: shutting down as on SIGTERM")
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        grace = self.config.timeout_graceful_shutdown
        if isinstance(drain, Drain) and grace and not self.force_exit:
            drain.draining = True
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            log.info("draining: new requests get 503 while those in flight finish", grace_s=grace)
            while self._busy(drain) and not self.force_exit and loop.time() < deadline:
                await asyncio.sleep(0.05)
            # uvicorn annotates this int, but only hands it to asyncio.timeout, which takes float seconds
            self.config.timeout_graceful_shutdown = max(0.0, deadline - loop.time())  # type: ignore[assignment]
        await super().shutdown(sockets)

    def _busy(self, drain: Drain) -> bool:
        return drain.in_flight > 0

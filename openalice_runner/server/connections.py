"""Connection guards below the app: a deadline for the request head and a cap on open connections.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but gives a client that sends its
request head slowly as long as it likes, before any route (or API key check) runs: a probe held
1,000 connections open for a minute sending one header byte a second. This h11 protocol closes a
connection whose head has not arrived `header_timeout_s` after the connection opened or after the
previous response, and answers 503 at once to a connection past `max_connections` (uvicorn's own
`limit_concurrency` only answers once the head is in, which a slow client never sends).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

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


class GuardedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False
        self._waiting_after: Any = None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            log.warning("connection refused: too many open", limit=self.max_connections)
            transport.write(_BUSY)
            transport.close()
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is not None:
            self._head_started = True
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._waiting_after:
            self._disarm_head_timer()  # a new request's head is in: its route runs now

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request on this connection must bring its head in time too (unless a pipelined
        # one already started, or the connection is closing).
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

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
        if self.transport.is_closing():
            return
        # A partial head gets a 408 saying why; an idle connection just closes (a 408 nobody asked
        # for could be read as the answer to the client's next request).
        if self._head_started:
            log.info("connection closed: request head too slow", timeout_s=self.header_timeout_s)
            self.transport.write(_HEAD_TIMEOUT)
        self.transport.close()


def guarded_h11(header_timeout_s: float, max_connections: int | None) -> type[GuardedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these limits."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
    )

"""A request's deadline and the race it runs against: its own work, the deadline, and the client leaving.

The client may bound a request with `X-OpenAlice-Timeout: SECONDS` or the body field `timeout`
(the smaller wins); the server's `--request-timeout` caps both. When the deadline passes, the work is
cancelled (the engine stops at its next round, the admission slot comes back) and the client gets
408 `deadline_exceeded`: a deadline is the caller's choice, not a server failure.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from openalice_runner.server.errors import APIError

HEADER_TIMEOUT = "x-openalice-timeout"
T = TypeVar("T")


class DeadlineExceeded(APIError):
    def __init__(self, deadline: Deadline) -> None:
        who = "the request's timeout" if deadline.source == "client" else "the server's request timeout"
        super().__init__(
            408,
            f"{who} of {deadline.seconds:g} s passed before the answer was complete",
            code="deadline_exceeded",
            type="timeout_error",
        )


class ClientGone(Exception):
    """The client closed its connection while its request was being served."""


@dataclass(frozen=True)
class Deadline:
    seconds: float
    source: str  # "client" or "server"
    at: float  # event loop time

    def remaining(self) -> float:
        return max(0.0, self.at - asyncio.get_running_loop().time())


def request_deadline(headers: Mapping[str, str], body_timeout: float | None, server_cap_s: float) -> Deadline:
    client = body_timeout
    raw = headers.get(HEADER_TIMEOUT)
    if raw is not None and raw.strip():
        try:
            value = float(raw.strip())
        except ValueError:
            raise APIError(
                400, f"X-OpenAlice-Timeout must be a number of seconds, got {raw[:40]!r}", param="timeout"
            ) from None
        if not math.isfinite(value) or value <= 0:
            raise APIError(400, "X-OpenAlice-Timeout must be a positive number of seconds", param="timeout")
        client = value if client is None else min(client, value)
    if client is not None and client < server_cap_s:
        seconds, source = client, "client"
    else:
        seconds, source = server_cap_s, "server"
    return Deadline(seconds, source, asyncio.get_running_loop().time() + seconds)


async def until_disconnected(receive: Any) -> None:
    """Returns when the client has gone (the request body is already read: what follows is the
    server's word that the connection closed)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race(work: Awaitable[T], deadline: Deadline, receive: Any) -> T:
    """`work`'s result, unless the deadline passes (DeadlineExceeded) or the client leaves (ClientGone)
    first; then `work` is cancelled and has ended before this returns."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(receive))
    try:
        done, _ = await asyncio.wait(
            {task, gone}, timeout=deadline.remaining(), return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
        await _cancel(task)
        if gone in done:
            raise ClientGone()
        raise DeadlineExceeded(deadline)
    finally:
        gone.cancel()
        if not task.done():  # we were cancelled ourselves (e.g. a forced shutdown)
            task.cancel()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    try:
        await task
    except BaseException:  # its own ending (CancelledError, or an error raised while stopping)
        if not task.done():
            raise

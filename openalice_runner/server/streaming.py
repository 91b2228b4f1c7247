"""Server-sent events for a streamed answer, in its wire's shape (a StreamFormat, server/wires/).

The stream's bookkeeping (in-flight gauge, the turn's step, metrics, closing the provider's stream)
runs exactly once however the stream ends: finished, failed mid-way (an error event, since the status
line is gone), cancelled by a client that went away, or never started at all (a client that left
before the first byte: then the body generator never runs, and GuardedStreamingResponse closes it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from starlette.responses import StreamingResponse

from openalice_runner.providers.base import ProviderBadResponse, StreamBroken
from openalice_runner.providers.streams import ChatStream
from openalice_runner.server.deadline import Deadline, DeadlineExceeded
from openalice_runner.server.errors import APIError
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.release.modes import PASS, ReleaseMode
from openalice_runner.server.release.paced import PaceRates
from openalice_runner.server.release.padding import padded
from openalice_runner.server.release.stream import released
from openalice_runner.server.turns import Step, TurnTracker
from openalice_runner.types import ChatChunk

if TYPE_CHECKING:  # the wires import this module (sse)
    from openalice_runner.server.wires.base import StreamFormat

log = structlog.get_logger("openalice_runner.server")


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class SSEStream:
    def __init__(
        self,
        *,
        first: ChatChunk | None,
        opened: AbstractAsyncContextManager[ChatStream],
        chunks: AsyncIterator[ChatChunk],
        step: Step,
        format: StreamFormat,
        turn_type: str,
        t0: float,
        tracker: TurnTracker,
        metrics: ServerMetrics,
        to_api_error: Callable[[BaseException], APIError],
        deadline: Deadline | None = None,
        release: ReleaseMode = PASS,
        rates: PaceRates | None = None,
        rate_key: str = "",
    ) -> None:
        # `opened` is the provider stream's context, already entered (`chunks` is what it gave): close()
        # leaves it, which stops the generation and frees the provider's slot.
        self.opened, self.step = opened, step
        # what leaves together, one write each, as the stream's release mode says (server/release/)
        self.groups = released(release, _chained(first, chunks), rates=rates or PaceRates(), rate_key=rate_key,
                               budget=first.budget if first is not None else None)
        self.padded = release.padded
        self.pad: Callable[[bytes], bytes] = padded if release.padded else _as_is
        self.deadline = deadline
        self.format, self.turn_type, self.t0 = format, turn_type, t0
        self.tracker, self.metrics, self.to_api_error = tracker, metrics, to_api_error
        self.calls: dict[int, list[str]] = {}  # tool call index -> [id, name]
        self.finish_reason: str | None = None
        self.usage: Any = None
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        error: BaseException | None = None
        last: ChatChunk | None = None
        first_token = False
        try:
            group = await self._next()
            while group is not None:
                for chunk in group:
                    last = chunk
                    self._note(chunk)
                    if not first_token and (chunk.delta_text or chunk.tool_call_deltas):
                        first_token = True
                        self.metrics.ttft.labels(turn_type=self.turn_type).observe(time.perf_counter() - self.t0)
                # the events a group becomes leave in one write: a send per event cost the Messages and
                # Responses wires (3 to 5 events where Chat has 1) ~0.4 ms each (bench/wire_overhead.py)
                data = b"".join(event for chunk in group for event in self.format.chunk(chunk))
                if data or (not group and self.padded):  # an empty group: a filler (release/clocked.py)
                    yield self.pad(data)
                group = await self._next()
            data = b"".join(self.format.end(last, self.usage))
            if data:
                yield self.pad(data)
        except Exception as exc:
            error = exc
            api_error = self.to_api_error(exc)
            # the cause, where it is ours to say (the shape of upstream's stream, not a message of
            # upstream's that might quote the request): what an operator needs to find the fault
            reason = str(exc)[:300] if isinstance(exc, StreamBroken | ProviderBadResponse) else None
            log.warning("stream failed", error_type=type(exc).__name__, status=api_error.status_code, reason=reason)
            yield self.pad(self.format.error(api_error))
        except BaseException as exc:  # cancelled: the client went away
            error = exc
            raise
        finally:
            await self.close(error)

    async def _next(self) -> list[ChatChunk] | None:
        """The next group of chunks, or None at the end; DeadlineExceeded when the request's time is up
        (the provider's stream is cancelled where it waits, so the engine stops at its next round; a
        paced stream's clock is cut where it waits)."""
        if self.deadline is None:
            try:
                return await self.groups.__anext__()
            except StopAsyncIteration:
                return None
        timeout = asyncio.timeout_at(self.deadline.at)
        try:
            async with timeout:
                return await self.groups.__anext__()
        except StopAsyncIteration:
            return None
        except TimeoutError:
            if timeout.expired():
                raise DeadlineExceeded(self.deadline) from None
            raise

    def _note(self, chunk: ChatChunk) -> None:
        for delta in chunk.tool_call_deltas:
            entry = self.calls.setdefault(delta.index, ["", ""])
            if delta.id:
                entry[0] = delta.id
            if delta.function and delta.function.name:
                entry[1] = delta.function.name
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage

    async def close(self, error: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):  # closing the provider's stream must not be cancelled itself
            try:  # the release first: a paced stream reads its chunks in a task it ends here
                await self.groups.aclose()
            except Exception as exc:
                log.warning("closing the stream's release failed", error_type=type(exc).__name__)
            try:
                if error is None:
                    await self.opened.__aexit__(None, None, None)
                else:  # the layers see why the stream ended (tracing records it)
                    await self.opened.__aexit__(type(error), error, error.__traceback__)
            except Exception as exc:  # already failed; the stream's own error is what counts
                log.warning("closing provider stream failed", error_type=type(exc).__name__)
        m = self.metrics
        m.in_flight.dec()
        tool_calls = [(cid, name) for cid, name in self.calls.values() if cid and name]
        self.tracker.finish(self.step, finish_reason=self.finish_reason, tool_calls=tool_calls, error=error)
        m.open_turns.set(len(self.tracker))
        if error is None:
            outcome = "ok"
        elif isinstance(error, DeadlineExceeded):
            outcome = "deadline"
            m.cancelled.labels(reason="deadline").inc()
        elif _is_cancel(error):
            outcome = "cancelled"
            m.cancelled.labels(reason="client_gone").inc()
        else:
            outcome = "error"
        m.chat_completions.labels(turn_type=self.turn_type, stream="true", outcome=outcome).inc()
        if self.usage is not None:
            m.tokens.labels(type="input").inc(self.usage.prompt_tokens)
            m.tokens.labels(type="output").inc(self.usage.completion_tokens)


async def _chained(first: ChatChunk | None, chunks: AsyncIterator[ChatChunk]) -> AsyncIterator[ChatChunk]:
    """The stream's first chunk (already read: None, an empty stream), then the rest."""
    if first is None:
        return
    yield first
    async for chunk in chunks:
        yield chunk


def _as_is(data: bytes) -> bytes:
    return data


def _is_cancel(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError | GeneratorExit | anyio.get_cancelled_exc_class())


class _ClientGone(asyncio.CancelledError):
    """The response ended before its body started: the client left."""


# A send that starts once the deadline has passed (the error event that says so, the stream's end)
# gets this long; a send that blocks past the deadline (a client that stopped reading) is cut.
SEND_GRACE_S = 5.0
# Set by the server's HTTP protocol (server/connections.py): closes the connection at once, dropping
# what is buffered for it. Elsewhere a cut stream just ends, and the server closes the connection.
ABORT_KEY = "openalice.abort_connection"


class _SendStalled(Exception):
    """A send was still blocked (the client does not read) when the request's deadline passed."""


class GuardedStreamingResponse(StreamingResponse):
    """StreamingResponse that runs `on_close` if the body generator never got to run its own cleanup,
    and holds the request's deadline while a send blocks: between chunks the stream checks it itself
    (SSEStream._next), but a client that stops reading leaves a send waiting for the socket to drain,
    for good, holding the provider's stream (and its slot) open."""

    def __init__(self, stream: SSEStream, **kwargs: Any) -> None:
        super().__init__(stream.events(), media_type="text/event-stream", **kwargs)
        self._on_close: Callable[[BaseException | None], Awaitable[None]] = stream.close
        self._deadline = stream.deadline

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        error: BaseException = _ClientGone()
        deadline = self._deadline
        try:
            await super().__call__(scope, receive, send if deadline is None else _bounded(send, deadline))
        except _SendStalled:
            assert deadline is not None
            error = DeadlineExceeded(deadline)
            log.info("stream cut: the client stopped reading and the request's deadline passed",
                     timeout_s=deadline.seconds)  # fmt: skip
            abort = scope.get(ABORT_KEY)
            if abort is not None:
                abort()
        finally:
            await self._on_close(error)  # a no-op when the stream closed itself


def _bounded(send: Callable[[Any], Awaitable[None]], deadline: Deadline) -> Callable[[Any], Awaitable[None]]:
    async def send_by_deadline(message: Any) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        at = deadline.at if now < deadline.at else now + SEND_GRACE_S
        timeout = asyncio.timeout_at(at)
        try:
            async with timeout:
                await send(message)
        except TimeoutError:
            if timeout.expired():
                raise _SendStalled() from None
            raise

    return send_by_deadline

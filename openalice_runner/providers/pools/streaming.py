"""A pool server's streamed reply read into ChatChunks: its SSE events, an error event, how the
stream ended, and the connection handed back after `[DONE]`. A failure before the first chunk tries
the next replica (NextReplica); after it, StreamBroken."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import (
    CallContext,
    ProviderBadResponse,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.pools.errors import NextReplica, error_from_body
from openalice_runner.types import ChatChunk, SpeculationInfo

if TYPE_CHECKING:
    from openalice_runner.providers.pools.pool import PoolProvider

# How long a stream's body may go on after `[DONE]` before its connection is given up (drain).
DRAIN_S = 1.0


async def sse_chunks(
    provider: PoolProvider, resp: httpx.Response, pool: str, ctx: CallContext
) -> AsyncGenerator[ChatChunk, None]:
    """SSE events -> ChatChunks. A failure before the first chunk tries the next replica
    (transport errors reach the attempt loop as they are); after it, StreamBroken."""
    acc = wire.ChunkAccumulator(provider.config.model)
    ext: dict[str, Any] = {}
    engine = provider.engine
    lines = resp.aiter_lines()
    try:
        async for line in lines:
            if not line.startswith("data:"):
                continue  # comments, `event:` lines (SGLang's framed `sglext_ids`), blanks
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            if isinstance(data, dict) and "error" in data:
                raise stream_error(provider, data["error"], acc.started)
            if isinstance(data, dict):
                provider.capture(ext, data)
            for chunk in acc.feed(wire.read_chunk(data, provider.name)):
                yield chunk
    except (json.JSONDecodeError, ProviderBadResponse) as exc:
        if acc.started:
            raise StreamBroken(f"{engine} stream unreadable: {exc}", provider=provider.name) from exc
        if isinstance(exc, ProviderBadResponse):
            raise
        raise ProviderBadResponse(f"{engine} stream event is not JSON: {exc}", provider=provider.name) from exc
    check_stream_end(provider, acc)
    usage = acc.usage  # None where the server sent none (no usage chunk): unknown
    outcome = provider.speculation(ext, pool, ctx, usage)
    yield acc.final(SpeculationInfo.from_outcome(outcome), provider.name).attach_outcome(outcome)
    await drain(lines)


def stream_error(provider: PoolProvider, body: Any, started: bool) -> Exception:
    """An SSE `error` event: StreamBroken once tokens went out; before, the next replica where
    the error allows a fallback, else the error itself."""
    err = error_from_body(body, provider.name)
    if started:
        return StreamBroken(f"{provider.engine} stream error: {err.message}", provider=provider.name)
    if err.fallback_ok:
        return NextReplica(f"stream error before the first token: {err.message}")
    return err


def check_stream_end(provider: PoolProvider, acc: wire.ChunkAccumulator) -> None:
    """A stream that ended without a finish, or aborted: broken after tokens, else retried or refused."""
    engine = provider.engine
    if acc.finish is None:
        if acc.started:
            raise StreamBroken(f"{engine} stream ended without a finish_reason", provider=provider.name)
        raise NextReplica("stream ended before any token")
    if acc.finish == "abort":
        if acc.started:
            raise StreamBroken(f"{engine} aborted the request mid-stream", provider=provider.name)
        raise ProviderUnavailable(f"{engine} aborted the request", provider=provider.name)


async def drain(lines: AsyncIterator[str]) -> None:
    """Read what follows `[DONE]` (the chunked body's end): a response read to its end hands its
    connection back to the pool; one left unread is closed, and the next call pays a new connect.
    A server that keeps the body open past `[DONE]` gets DRAIN_S, then its connection is closed."""
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass

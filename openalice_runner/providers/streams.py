"""ChatStream: a provider's streamed answer, alive only inside its `async with` block.

`Provider.stream(request, ctx)` returns an async context manager; entering it starts the call and
gives a ChatStream, leaving it (at the end, by an exception, or by cancellation) closes the
generation underneath at once: the local engine stops within a decode step, an admission slot is
freed, an HTTP response is closed. Closing is the block's job, never the garbage collector's.

    async with provider.stream(request, ctx) as chunks:
        async for chunk in chunks:
            ...

A wrapper opens the stream it wraps inside its own block (`async with self.wrapped.stream(...)`),
so every layer is closed, innermost last, however the caller leaves.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

from openalice_runner.types import ChatChunk


class ChatStream:
    """The chunks of one streamed answer; the last carries finish_reason and usage."""

    def __init__(self, chunks: AsyncIterator[ChatChunk]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> ChatChunk:
        return await self._chunks.__anext__()


@asynccontextmanager
async def chat_stream(chunks: AsyncGenerator[ChatChunk, None]) -> AsyncIterator[ChatStream]:
    """The context a provider hands out for an async generator of chunks: the generator is closed
    when the block is left, so its own `finally` (and any `async with` inside it) runs then."""
    try:
        yield ChatStream(chunks)
    finally:
        await chunks.aclose()

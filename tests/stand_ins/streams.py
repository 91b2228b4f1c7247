"""Reading a provider's stream to the end in tests, the way callers must: inside its `async with`."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from openalice_runner.providers.streams import ChatStream
from openalice_runner.types import ChatChunk


async def read_all(opened: AbstractAsyncContextManager[ChatStream]) -> list[ChatChunk]:
    async with opened as chunks:
        return [c async for c in chunks]

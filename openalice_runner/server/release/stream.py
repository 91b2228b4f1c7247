"""A stream's chunks as the groups that leave together (server/release/__init__.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from openalice_runner.server.release.fixed import fixed
from openalice_runner.server.release.modes import ReleaseMode
from openalice_runner.server.release.paced import LoopClock, PaceRates, paced
from openalice_runner.types import ChatChunk


def released(
    mode: ReleaseMode, chunks: AsyncIterator[ChatChunk], *, rates: PaceRates, rate_key: str
) -> AsyncGenerator[list[ChatChunk], None]:
    """The stream's chunks as the groups that leave together (one write each), as `mode` says."""
    if mode.kind == "fixed":
        return fixed(chunks, mode.n)
    if mode.kind == "paced":
        return paced(chunks, rates.pacer(rate_key), LoopClock(), on_end=lambda rate: rates.record(rate_key, rate))
    return _one_by_one(chunks)


async def _one_by_one(chunks: AsyncIterator[ChatChunk]) -> AsyncGenerator[list[ChatChunk], None]:
    async for chunk in chunks:
        yield [chunk]

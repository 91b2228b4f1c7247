"""A stream's chunks as the groups that leave together (server/release/__init__.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from openalice_runner.server.release.clocked import clock_rate, clocked
from openalice_runner.server.release.fixed import fixed
from openalice_runner.server.release.modes import ReleaseMode
from openalice_runner.server.release.paced import LoopClock, PaceRates, paced
from openalice_runner.types import ChatChunk

UNHELD_RATE = 1e9  # tokens a second of a clock that holds nothing


def released(
    mode: ReleaseMode, chunks: AsyncIterator[ChatChunk], *, rates: PaceRates, rate_key: str,
    budget: int | None = None,
) -> AsyncGenerator[list[ChatChunk], None]:
    """The stream's chunks as the groups that leave together (one write each), as `mode` says.
    `budget`: the request's max_tokens, what a `+pad` mode pads the reply to (None: not known).

    fixed:N and paced leave on the clock of the tenant's recent streams (clocked.py); the first
    stream of a tenant, model and turn type has none yet, and leaves as it is produced (fixed:N) or on its own
    rate (paced.py), which it records for the next."""
    if mode.kind == "pass":
        return _one_by_one(chunks)
    n = mode.n if mode.kind == "fixed" else 1
    recent = rates.rate(rate_key)

    def record(rate: float | None) -> None:
        rates.record(rate_key, rate)

    pad_to = (budget or 0) if mode.pad_length else None
    if recent is not None:
        clock = rates.hold(rate_key, clock_rate(recent, rates.clocks.get(rate_key)))
        return clocked(fixed(chunks, n), n, clock, LoopClock(), pad_to=pad_to, on_end=record)
    if mode.kind == "fixed":  # a clock that never holds a group: it leaves as it completes
        return clocked(fixed(chunks, n), n, UNHELD_RATE, LoopClock(), pad_to=pad_to, on_end=record)
    return paced(chunks, rates.pacer(rate_key), LoopClock(), on_end=record)


async def _one_by_one(chunks: AsyncIterator[ChatChunk]) -> AsyncGenerator[list[ChatChunk], None]:
    async for chunk in chunks:
        yield [chunk]

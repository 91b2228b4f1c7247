"""Writes on a clock that this request's speculation does not set: how fixed:N and paced leave once
the tenant has a measured rate (stream.py).

fixed:N's groups (fixed.py; paced: groups of 1) leave on a grid: the k-th write is due at
A + (k + LEAD_SLOTS) * P, where A is when the stream's release began (its first chunk) and the
period P = N / rate. The rate is the recent streams' decode rate of the request's tenant, model and turn type
(PaceRates: the slowest of its last finished streams, never this one), taken at RATE_MARGIN of it so that the
engine is usually ahead of the clock, and rounded down to a grid of rates (RATE_STEPS a doubling) so
small changes of that rate do not move the grid stream by stream. Measured before this (the bench,
docs/benchmarks/2026-12-05-side-channel.md): a group released when its pass completes, or a clock set
from the stream's own rate, times the writes by this request's acceptance.

- A group that is not complete when its write is due (the engine behind the clock) leaves at the
  first grid point after it completes: the grid is kept, so a stall shows as whole periods only.
- The lag is bounded in time: a group complete for MAX_LAG_S or more leaves at once (each such group
  its own write of N, back to back: the one place the production shows), and the grid goes on from
  the next point; at RATE_MARGIN that takes a reply of about MAX_LAG_S * rate / (1 - RATE_MARGIN)
  tokens produced at the usual rate.
- `pad_to` (the `+pad` modes): after the reply's last token, filler writes (empty groups: the
  server writes them as padding alone, padding.py) on the same grid until the stream has had
  ceil(pad_to / N) writes of tokens (a reply whose text cuts into more units has the rest in its
  last: `_last_holds_rest`), then the end (finish reason, usage) on the next point: the count
  of writes and the end time say only that the reply was at most `pad_to` tokens (the request's
  max_tokens; where no budget is known, the reply's length rounded up to a power of two, which they
  then say). Costs the client the wait for the fillers; its tokens are all out before them.

The stream's own rate is measured here as well (from when its groups completed) and reported to
`on_end`, for the next streams' clock."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import anyio

from openalice_runner.server.release.paced import MAX_RATE, MIN_RATE, Clock
from openalice_runner.types import ChatChunk

RATE_MARGIN = 0.75  # the clock runs at this share of the tenant's recent decode rate
RATE_STEPS = 4  # rates the clock runs at: 2 ** (k / RATE_STEPS) tokens a second
HOLD_STEPS = 2  # the clock moves up only to a grid point this many steps above the one it ran at
LEAD_SLOTS = 2  # the first write is due this many periods after the first chunk
MAX_LAG_S = 1.0  # a complete group waits at most this long
MIN_PAD = 16  # tokens a `+pad` reply is padded to at least when the request's budget is not known


def clock_rate(recent: float, held: float | None = None) -> float:
    """The clock's rate for a tenant whose recent streams decoded at `recent` tokens a second; `held`:
    the rate the tenant's last clocked stream ran at. The clock moves down to the grid point at once (a
    clock ahead of the engine shows its stalls) but up only when that point is HOLD_STEPS or more above
    the held one: a rate near a grid point would otherwise flip the clock stream by stream, each
    stream's period then telling which way the last streams' texts went (measured:
    docs/benchmarks/2026-12-05-side-channel-3.md)."""
    rate = min(MAX_RATE, max(MIN_RATE, RATE_MARGIN * recent))
    step = math.floor(math.log2(rate) * RATE_STEPS)
    if held is not None:
        held_step = round(math.log2(held) * RATE_STEPS)
        if held_step <= step < held_step + HOLD_STEPS:
            step = held_step
    return 2 ** (step / RATE_STEPS)


def _has_tokens(chunk: ChatChunk) -> bool:
    return bool(chunk.delta_text or chunk.tool_call_deltas)


def _split_end(group: list[ChatChunk]) -> tuple[list[ChatChunk], list[ChatChunk]]:
    """The last group as its tokens (with the markers among them) and the end after them."""
    cut = len(group)
    while cut and not _has_tokens(group[cut - 1]):
        cut -= 1
    return group[:cut], group[cut:]


_END = object()


class _Grid:
    """The stream's grid points: the k-th is A + k * period; `slot` is the next write's."""

    def __init__(self, anchor: float, period: float) -> None:
        self.anchor, self.period, self.slot = anchor, period, LEAD_SLOTS

    def due(self) -> float:
        return self.anchor + self.slot * self.period

    def after(self, at: float) -> None:
        """The next write is due at the first grid point at or after `at` (never an earlier one)."""
        self.slot = max(self.slot, math.ceil((at - self.anchor) / self.period - 1e-9))


class _Ready:
    """Complete groups waiting for their grid point, and the stream's own production rate."""

    def __init__(self) -> None:
        self.groups: deque[tuple[float, list[ChatChunk]]] = deque()
        self.completed: list[float] = []  # when each group completed
        self.written = 0  # groups of tokens written so far

    def add(self, group: list[ChatChunk], at: float) -> None:
        self.completed.append(at)
        self.groups.append((at, group))

    def overdue(self, now: float) -> bool:
        return bool(self.groups) and now >= self.groups[0][0] + MAX_LAG_S  # as the wait's deadline is written

    def all(self) -> list[ChatChunk]:
        out = [chunk for _, group in self.groups for chunk in group]
        self.written += len(self.groups)
        self.groups.clear()
        return out

    def rate(self, n: int, ended: bool) -> float | None:
        """Full groups after the first over the time between their completions (the last may be short)."""
        full = self.completed[:-1] if ended else self.completed
        span = full[-1] - full[0] if len(full) >= 2 else 0.0
        return n * (len(full) - 1) / span if span > 0 else None


async def clocked(
    groups: AsyncIterator[list[ChatChunk]], n: int, rate: float, clock: Clock, *,
    pad_to: int | None = None, on_end: Callable[[float | None], None] | None = None,
) -> AsyncGenerator[list[ChatChunk], None]:
    grid, ready = _Grid(clock.now(), n / rate), _Ready()
    groups = _capped(groups, pad_to, n)
    ended = False
    pending: asyncio.Future[Any] | None = None
    try:
        while not ended or ready.groups:
            if not ended and pending is None:
                pending = asyncio.ensure_future(anext(groups, _END))
            now = clock.now()
            if _leaves_now(ready, grid, now):
                _, group = ready.groups.popleft()
                if pad_to is not None and _ends_reply(group, ended, ready):
                    async for write in _padded_end(group, grid, ready, clock, _pad_writes(pad_to, n, ready.written + 1)):
                        yield write
                    continue
                _written(ready, grid, now)
                yield group
                continue
            until = min(grid.due(), ready.groups[0][0] + MAX_LAG_S) if ready.groups else None
            if pending is None:  # ended: a group waits for its point
                await clock.wait(None, until)
                continue
            stalled = not ready.groups
            await clock.wait(pending, until)
            if not pending.done():
                continue
            rest = _before_error(pending, ready)
            if rest:
                yield rest
            group, pending = pending.result(), None  # the error, where the stream broke
            if group is _END:
                ended = True
                continue
            ready.add(group, clock.now())
            if stalled:  # the engine was behind the clock: the first grid point after the group
                grid.after(clock.now())
    finally:
        await _settled(pending)
        if on_end is not None:
            on_end(ready.rate(n, ended))


# The steps of `clocked`'s loop, apart so that the loop reads as its states (and stays under C901's bound).


def _leaves_now(ready: _Ready, grid: _Grid, now: float) -> bool:
    """Whether the first ready group leaves now: its grid point has come, or it is overdue (the lag's
    bound: the overdue groups leave now, each its own write of N, and the grid goes on after now)."""
    overdue = ready.overdue(now)
    if overdue:
        grid.after(now)
    return overdue or (bool(ready.groups) and now >= grid.due())


def _ends_reply(group: list[ChatChunk], ended: bool, ready: _Ready) -> bool:
    """The reply's last group: it holds the stream's finish (fixed.py), or the stream ended after it."""
    return (ended and not ready.groups) or any(c.finish_reason for c in group)


def _written(ready: _Ready, grid: _Grid, now: float) -> None:
    """A group of tokens was written on its point; the next is due on the next point, unless the
    next group is overdue too (it leaves on this point)."""
    ready.written += 1
    if not ready.overdue(now):
        grid.slot += 1


def _before_error(pending: asyncio.Future[Any], ready: _Ready) -> list[ChatChunk]:
    """Where the read of the next group failed, what was produced (it still leaves, as in pass mode,
    then the error); otherwise nothing."""
    if not pending.cancelled() and pending.exception() is not None:
        return ready.all()
    return []


async def _settled(pending: asyncio.Future[Any] | None) -> None:
    """The read of the next group ended: cancelled if it waits (the groups' stream is closed once this
    returns), its exception retrieved (the stream's own ending is what counts)."""
    if pending is None:
        return
    if not pending.done():
        pending.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.wait({pending})
    if not pending.cancelled():
        pending.exception()


def _pad_writes(pad_to: int, n: int, groups: int) -> int:
    """Writes of tokens a padded reply has: `pad_to` tokens' worth; with no budget known (0), the
    reply's groups rounded up to a power of two tokens (at least MIN_PAD)."""
    if pad_to > 0:
        return -(-pad_to // n)
    return -(-max(MIN_PAD, 1 << (groups * n - 1).bit_length()) // n)


def _capped(groups: AsyncIterator[list[ChatChunk]], pad_to: int | None, n: int) -> AsyncIterator[list[ChatChunk]]:
    """With a budget to pad to, at most its ceil(pad_to / n) writes of tokens (`_last_holds_rest`)."""
    return _last_holds_rest(groups, _pad_writes(pad_to, n, 0)) if pad_to else groups


async def _last_holds_rest(groups: AsyncIterator[list[ChatChunk]], writes: int) -> AsyncGenerator[list[ChatChunk], None]:
    """At most `writes` groups, the last holding the rest of the reply: a budget counts model tokens
    and a group units of text (units.py), of which a reply has more where a token is two ("'s": a
    mark and a letter), so the count of writes would otherwise tell that of the text (measured at
    temperature 0.7: docs/benchmarks/2026-12-05-side-channel-4.md). The writes' sizes are bucketed
    (padding.py): a few more units in the last say nothing."""
    taken = 0
    rest: list[ChatChunk] = []
    async for group in groups:
        if taken < writes - 1:
            taken += 1
            yield group
        else:
            rest += group
    if rest:
        yield rest


async def _padded_end(group: list[ChatChunk], grid: _Grid, ready: _Ready, clock: Clock,
                      writes: int) -> AsyncGenerator[list[ChatChunk], None]:
    """The last group's tokens on its point, fillers on the next until `writes` writes of tokens,
    then the end on the next."""
    tokens, end = _split_end(group)
    if tokens:
        ready.written += 1
        grid.slot += 1
        yield tokens
    while ready.written < writes:
        await clock.wait(None, grid.due())
        ready.written += 1
        grid.slot += 1
        yield []  # a filler: padding alone
    await clock.wait(None, grid.due())
    grid.slot += 1
    if end:
        yield end

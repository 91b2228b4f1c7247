"""paced: one token (units.py) an event, on a steady clock set from the measured decode rate, never
more than one pass behind what was produced.

The rate is the stream's own tokens a second since its first pass, (tokens after the first pass) /
(time since it), which steadies as the stream goes on, started from the slowest of recent streams' rates
(`PaceRates`, weighted as `PRIOR_WEIGHT_S` seconds of this stream). Ticks are 1/rate apart; a tick
that finds nothing to send (the engine slower than the clock) waits for the next pass, and the clock
resumes on its grid, not at the pass's arrival. The bound: when pass k+1 arrives, every token of the
passes before k has left (what the clock had not sent goes at once, in one catch-up event): the
stream is never more than one pass behind. So the gaps between events show the average rate, not
how many tokens each pass accepted, except where a pass more than about twice the average forces a
catch-up. A token is complete (and counted as produced) once the text after it arrived (units.py).

Every wait is for the clock or the next chunk; the stream's caller bounds it by the request's
deadline and cancels it when the client leaves (server/streaming.py).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from openalice_runner.server.release.units import Atom, Builder, Cutter
from openalice_runner.types import ChatChunk

PRIOR_WEIGHT_S = 1.0  # recent streams' rate counts as this many seconds of this stream's own
# a key's clock starts from the slowest of its last RECENT_STREAMS streams, not their mean: a stream
# slower than the clock stalls and its gaps then show its own text (tokens per unit, acceptance);
# measured with a mean (an EMA): docs/benchmarks/2026-12-05-side-channel-4.md
RECENT_STREAMS = 8
MIN_RATE, MAX_RATE = 1.0, 10_000.0  # tokens a second the clock may run at
MAX_RATE_KEYS = 256  # PaceRates keeps this many keys (model names), the oldest dropped


class Clock(Protocol):
    def now(self) -> float: ...

    async def wait(self, pending: asyncio.Future[Any] | None, until: float | None) -> None:
        """Returns when `pending` is done or `until` has passed (None: no limit; never both None)."""
        ...


class LoopClock:
    """The event loop's clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def wait(self, pending: asyncio.Future[Any] | None, until: float | None) -> None:
        timeout = None if until is None else max(0.0, until - self.now())
        if pending is None:
            await asyncio.sleep(timeout or 0.0)
        else:
            await asyncio.wait({pending}, timeout=timeout)


@dataclass
class Pacer:
    """The clock of one stream: its measured rate and when the next token is due."""

    prior: float | None = None  # tokens a second of recent streams
    first_at: float | None = None
    last_at: float | None = None  # the latest pass
    produced: int = 0  # tokens of the passes after the first
    sent_at: float | None = None  # the latest tick

    def arrived(self, units: int, at: float) -> None:
        if self.first_at is None:
            self.first_at = at
        else:
            self.produced += units
        self.last_at = at

    def rate(self) -> float | None:
        """Tokens a second (None: not known yet: one pass and no recent streams)."""
        weight = PRIOR_WEIGHT_S if self.prior is not None else 0.0
        elapsed = (self.last_at or 0.0) - (self.first_at or 0.0)
        if weight + elapsed <= 0 or (weight == 0 and self.produced == 0):
            return None
        rate = ((self.prior or 0.0) * weight + self.produced) / (weight + elapsed)
        return min(MAX_RATE, max(MIN_RATE, rate))

    def due(self) -> float | None:
        """When the next token may leave (None: not known until the next pass)."""
        if self.sent_at is None:
            return self.last_at  # the first token leaves as it completes: time to first token kept
        rate = self.rate()
        return None if rate is None else self.sent_at + 1.0 / rate

    def sent(self, at: float) -> None:
        self.sent_at = at

    def resume(self, at: float) -> None:
        """Nothing was left to send until `at`: the next tick is the clock's first one at or after it."""
        rate = self.rate()
        if self.sent_at is None or rate is None:
            return
        interval = 1.0 / rate
        if self.sent_at + interval < at:
            self.sent_at += (math.ceil((at - self.sent_at) / interval) - 1) * interval


@dataclass
class PaceRates:
    """Recent streams' decode rates a key (the request's tenant, model and turn type), where a
    clocked stream starts: `rate(key)`, the slowest of the key's last RECENT_STREAMS. Keyed by
    tenant, so one tenant's texts never set where another's streams start; by turn type, so a
    tenant's fast copy-heavy turns (speculation accepting most drafts) do not set the clock of its
    chat turns, which could not keep it."""

    recent: dict[str, deque[float]] = field(default_factory=dict)  # the key's last streams' rates
    clocks: dict[str, float] = field(default_factory=dict)  # the rate a key's last clocked stream ran at

    def rate(self, key: str) -> float | None:
        """The slowest of the key's recent streams (None: none yet)."""
        last = self.recent.get(key)
        return min(last) if last else None

    def pacer(self, key: str) -> Pacer:
        return Pacer(prior=self.rate(key))

    def record(self, key: str, rate: float | None) -> None:
        if rate is None:
            return
        last = self.recent.pop(key, None) or deque(maxlen=RECENT_STREAMS)
        last.append(rate)
        self.recent[key] = last  # the latest key last: _bound drops the oldest
        _bound(self.recent)

    def hold(self, key: str, clock: float) -> float:
        """`clock`, kept as the rate `key`'s streams run at until the next is clocked."""
        self.clocks.pop(key, None)
        self.clocks[key] = clock
        _bound(self.clocks)
        return clock


def _bound(table: dict) -> None:
    while len(table) > MAX_RATE_KEYS:  # bounded whatever names requests bring: the oldest go
        del table[next(iter(table))]


_END = object()


class _Queue:
    """Atoms waiting to leave, each with the pass that completed it."""

    def __init__(self) -> None:
        self.atoms: deque[tuple[Atom, int]] = deque()
        self.units = 0
        self.builder = Builder()

    def add(self, atoms: list[Atom], done_by: int) -> int:
        self.atoms.extend((atom, done_by) for atom in atoms)
        units = sum(atom.units for atom in atoms)
        self.units += units
        return units

    def behind(self, done_by: int) -> bool:
        """Whether a token of a pass up to `done_by` is still here."""
        return any(atom.units and k <= done_by for atom, k in self.atoms)

    def take(self, *, upto: int | None = None, ended: bool = False) -> list[ChatChunk]:
        """The next token (every token of the passes up to `upto`), with the markers before it; once the
        stream ended, the markers after the last token as well."""
        atoms: list[Atom] = []
        taken = 0
        while self.atoms:
            atom, done_by = self.atoms[0]
            if atom.units and (done_by > upto if upto is not None else taken == 1):
                break
            self.atoms.popleft()
            atoms.append(atom)
            taken += atom.units
        self.units -= taken
        if ended and not self.units:
            atoms += [atom for atom, _ in self.atoms]
            self.atoms.clear()
        return self.builder.build(atoms)


class _Stream:
    """One paced stream's state between the generator's steps."""

    def __init__(self, pacer: Pacer) -> None:
        self.pacer, self.cutter, self.queue = pacer, Cutter(), _Queue()
        self.passes = 0
        self.ended = False

    def arrived(self, chunk: Any, now: float, *, starved: bool) -> list[ChatChunk] | None:
        """Take in the next chunk (or the end); what must leave at once to stay one pass behind."""
        if chunk is _END:
            self.ended = True
            self.queue.add(self.cutter.flush(), self.passes)
            return None
        if starved:
            self.pacer.resume(now)
        self.passes += 1
        self.pacer.arrived(self.queue.add(self.cutter.feed(chunk), self.passes), now)
        if not self.queue.behind(self.passes - 2):
            return None
        self.pacer.sent(now)
        return self.queue.take(upto=self.passes - 2)


async def _next_chunk(
    state: _Stream, pending: asyncio.Future[Any], due: float | None, clock: Clock
) -> tuple[asyncio.Future[Any] | None, list[ChatChunk] | None, BaseException | None]:
    """Wait for the next chunk until the tick is due: (the chunk's future while it is still pending,
    what must leave now, the stream's own error after what was produced)."""
    starved = not state.queue.units
    await clock.wait(pending, due)
    if not pending.done():  # the tick is due
        return pending, None, None
    broke = None if pending.cancelled() else pending.exception()
    if broke is not None:  # what was produced still leaves, as in pass mode, then the error
        state.queue.add(state.cutter.flush(), state.passes)
        out = state.queue.take(upto=state.passes, ended=True) if state.queue.atoms else None
        return None, out, broke
    catch_up = state.arrived(pending.result(), clock.now(), starved=starved)
    return None, catch_up or None, None  # the bound: never more than one pass behind


async def _settle(pending: asyncio.Future[Any]) -> None:
    """The next chunk's future, given up: cancelled and waited for, its exception retrieved."""
    if not pending.done():
        pending.cancel()
        with anyio.CancelScope(shield=True):  # the stream's chunks are closed once this returns
            await asyncio.wait({pending})
    if not pending.cancelled():
        pending.exception()  # retrieved: the stream's own ending is what counts


async def paced(
    chunks: AsyncIterator[ChatChunk], pacer: Pacer, clock: Clock, *,
    on_end: Callable[[float | None], None] | None = None,
) -> AsyncGenerator[list[ChatChunk], None]:
    state = _Stream(pacer)
    queue = state.queue
    pending: asyncio.Future[Any] | None = None
    try:
        while not state.ended or queue.units:
            if not state.ended and pending is None:
                pending = asyncio.ensure_future(anext(chunks, _END))
            due = pacer.due() if queue.units else None
            if pending is not None and (due is None or due > clock.now()):
                pending, out, broke = await _next_chunk(state, pending, due, clock)
                if out is not None:
                    yield out
                if broke is not None:
                    raise broke
                continue
            if due is None:  # the stream ended before a rate was known: what is left goes now
                yield queue.take(upto=state.passes, ended=True)
                continue
            if due > clock.now():
                await clock.wait(None, due)
            yield queue.take(ended=state.ended)
            pacer.sent(due if clock.now() - due < 1.0 / (pacer.rate() or MAX_RATE) else clock.now())
        if queue.atoms:  # the markers after the last token
            yield queue.take(ended=True)
    finally:
        if pending is not None:
            await _settle(pending)
        if on_end is not None:
            on_end(pacer.rate() if pacer.produced else None)

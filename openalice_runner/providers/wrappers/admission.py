"""Admission control: per provider, a limit on requests in flight and a bounded queue before it.

A request that finds every slot taken waits in the provider's queue (in asyncio, so a deadline or a
client that leaves takes it out at once); a request that finds the queue full too is refused at once
with `AdmissionRefused` (a `ProviderRateLimited`: the fallback chain may try the next provider, and
the sidecar answers 429 with Retry-After). Nothing is queued without bound.

The gate is one object per provider, shared by every route that names the provider. The Runner puts
it outermost on each provider of a chain (`AdmittedProvider`), so a refused request costs no policy
decision and no span; the sidecar can also `peek` at the gates to refuse before doing any work.

Retry-After is an estimate, not a promise: the mean time a slot has been held (an EWMA) times the
rounds of slots the queue ahead needs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field

from openalice_runner.providers.base import CallContext, Provider, ProviderLoad, ProviderRateLimited
from openalice_runner.providers.streams import ChatStream
from openalice_runner.providers.wrappers.wrapper import WrapperProvider
from openalice_runner.types import ChatRequest, ChatResult

# Built-in limits where neither the provider's YAML nor the server's flags set one. The embedded
# engine decodes up to its max_batch (8 by default) requests together; more in flight would only
# wait in its scheduler, where a deadline cannot reach them. Remote providers batch on their side.
DEFAULT_MAX_IN_FLIGHT = {"local": 8}
DEFAULT_MAX_IN_FLIGHT_REMOTE = 64
DEFAULT_MAX_QUEUE = 16
_RETRY_AFTER_MAX_S = 60


class AdmissionLimits(BaseModel):
    """What an operator sets, per provider in the routing YAML or for all of them with serve flags."""

    model_config = ConfigDict(extra="forbid")

    max_in_flight: int | None = Field(default=None, ge=1, le=100_000)
    max_queue: int | None = Field(default=None, ge=0, le=100_000)

    def over(self, defaults: AdmissionLimits | None) -> AdmissionLimits:
        """These limits, with the unset ones taken from `defaults`."""
        if defaults is None:
            return self
        return AdmissionLimits(
            max_in_flight=self.max_in_flight if self.max_in_flight is not None else defaults.max_in_flight,
            max_queue=self.max_queue if self.max_queue is not None else defaults.max_queue,
        )


class AdmissionRefused(ProviderRateLimited):
    """The provider's slots and queue are full: refused before any work was done."""


@dataclass
class GateStats:
    in_flight: int
    queued: int
    max_in_flight: int
    max_queue: int
    admitted: int
    refused: int


class AdmissionGate:
    def __init__(self, provider: str, max_in_flight: int, max_queue: int) -> None:
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        self.provider = provider
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.in_flight = 0
        self.admitted = 0
        self.refused = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._held_s = 0.0  # EWMA of how long a slot is held

    @classmethod
    def for_provider(cls, name: str, kind: str, limits: AdmissionLimits) -> AdmissionGate:
        in_flight = limits.max_in_flight or DEFAULT_MAX_IN_FLIGHT.get(kind, DEFAULT_MAX_IN_FLIGHT_REMOTE)
        queue = limits.max_queue if limits.max_queue is not None else DEFAULT_MAX_QUEUE
        return cls(name, in_flight, queue)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def stats(self) -> GateStats:
        return GateStats(
            self.in_flight, self.queued, self.max_in_flight, self.max_queue, self.admitted, self.refused
        )

    def full(self) -> bool:
        """Would a request arriving now be refused?"""
        return self.in_flight >= self.max_in_flight and self.queued >= self.max_queue

    def retry_after_s(self) -> float:
        rounds = (self.queued + 1) / self.max_in_flight
        return float(min(_RETRY_AFTER_MAX_S, max(1, math.ceil(self._held_s * rounds))))

    def refusal(self) -> AdmissionRefused:
        return AdmissionRefused(
            f"busy: {self.in_flight} request(s) in flight and {self.queued} queued "
            f"(limits {self.max_in_flight} and {self.max_queue})",
            provider=self.provider,
            status_code=429,
            retry_after=self.retry_after_s(),
        )

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if there is room there; refuse at once otherwise."""
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            self.admitted += 1
            return
        if self.queued >= self.max_queue:
            self.refused += 1
            raise self.refusal()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # release() hands its slot over by resolving this future
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot arrived just as we were cancelled: pass it on
            else:
                self._waiters.remove(waiter)
            raise
        self.admitted += 1

    def resize(self, max_in_flight: int, max_queue: int) -> None:
        """New limits, live (an edited routing file). More slots start waiting requests now; a smaller
        queue keeps who is already in it and refuses newcomers until it is below the new bound."""
        if max_in_flight < 1 or max_queue < 0:
            raise ValueError("max_in_flight must be >= 1 and max_queue >= 0")
        self.max_in_flight, self.max_queue = max_in_flight, max_queue
        while self.in_flight < self.max_in_flight and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def release(self, held_s: float | None = None) -> None:
        if held_s is not None:
            self._held_s = held_s if self._held_s == 0 else 0.8 * self._held_s + 0.2 * held_s
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot goes to the next in line; in_flight stays
                return
        self.in_flight -= 1


class AdmittedProvider(WrapperProvider):
    """A provider behind its gate: a slot is held from admission until the answer (or stream) ends."""

    def __init__(self, wrapped: Provider, gate: AdmissionGate) -> None:
        super().__init__(wrapped)
        self.gate = gate

    def load(self) -> ProviderLoad:
        inner = self.wrapped.load()
        return replace(inner, queue_depth=(inner.queue_depth or 0) + self.gate.queued)

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        self.wrapped.precheck(request)  # a request that can never be served does not queue
        await self.gate.acquire()
        t0 = time.perf_counter()
        try:
            return await self.wrapped.chat(request, ctx)
        finally:
            self.gate.release(time.perf_counter() - t0)

    @asynccontextmanager
    async def stream(self, request: ChatRequest, ctx: CallContext) -> AsyncIterator[ChatStream]:
        self.wrapped.precheck(request)
        await self.gate.acquire()
        t0 = time.perf_counter()
        try:
            async with self.wrapped.stream(request, ctx) as chunks:
                yield chunks
        finally:  # the generation is stopped (the block above closed it) before the slot goes on
            self.gate.release(time.perf_counter() - t0)

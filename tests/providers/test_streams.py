"""Streams close when their `async with` block is left: at the end, by break, by an exception or by
cancellation, through every wrapper the Runner puts around a provider; wrappers forward only the
Provider interface."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from stand_ins.streams import read_all

from openalice_runner.policies import PolicyStore
from openalice_runner.providers.base import CallContext, Provider, ProviderUnavailable
from openalice_runner.providers.config import RoutingConfig
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.admission import AdmissionGate, AdmittedProvider
from openalice_runner.providers.wrappers.fallback import FallbackProvider
from openalice_runner.providers.wrappers.instrumented import InstrumentedProvider
from openalice_runner.providers.wrappers.policy import PolicyProvider
from openalice_runner.providers.wrappers.wrapper import WrapperProvider
from openalice_runner.runner import Runner
from openalice_runner.server.runner_protocol import ServedRunner
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.types import ChatChunk, ChatRequest

REQ = ChatRequest(messages=[{"role": "user", "content": "hello"}])


class Recording(Provider):
    """Streams `n` chunks (waiting on `hold` before each one after the first when set) and records
    how each generation ended: "finished", or "closed" when it was stopped before its end."""

    kind = "local"

    def __init__(self, name: str = "rec", n: int = 5, error: Exception | None = None) -> None:
        self.name = name
        self.n = n
        self.error = error  # raised before the first chunk
        self.hold: asyncio.Event | None = None
        self.ends: list[str] = []
        self.extra = "only on the bare provider"

    async def chat(self, request, ctx):
        raise NotImplementedError

    def stream(self, request, ctx):
        return chat_stream(self._generate())

    async def _generate(self):
        ended = "closed"
        try:
            if self.error is not None:
                raise self.error
            for i in range(self.n):
                if i and self.hold is not None:
                    await self.hold.wait()
                yield ChatChunk.text("id", "m", f"t{i} ", role=i == 0)
            yield ChatChunk(id="id", model="m", choices=[{"finish_reason": "stop"}])
            ended = "finished"
        finally:
            self.ends.append(ended)


class Stack:
    """The Runner's layering, built by hand: Fallback(Admitted(Policy(Instrumented(provider))))."""

    def __init__(self, *providers: Recording) -> None:
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        telemetry = RunnerTelemetry(tracer_provider, MeterProvider(metric_readers=[InMemoryMetricReader()]))
        store = PolicyStore.from_file("policies/default.yaml")
        self.gates = [AdmissionGate(p.name, max_in_flight=1, max_queue=0) for p in providers]
        self.chain = FallbackProvider(
            [
                AdmittedProvider(PolicyProvider(InstrumentedProvider(p, telemetry), store), gate)
                for p, gate in zip(providers, self.gates, strict=True)
            ]
        )

    def open(self):
        return self.chain.stream(REQ, CallContext())

    def slots_held(self) -> list[int]:
        return [gate.in_flight for gate in self.gates]

    def call_spans(self):
        return [s for s in self.spans.get_finished_spans() if s.name.startswith("chat")]


async def test_a_stream_read_to_the_end_finishes_every_layer():
    rec = Recording()
    stack = Stack(rec)
    chunks = await read_all(stack.open())
    assert "".join(c.delta_text for c in chunks) == "t0 t1 t2 t3 t4 " and chunks[-1].finish_reason == "stop"
    assert rec.ends == ["finished"] and stack.slots_held() == [0]
    [span] = stack.call_spans()
    assert span.status.status_code is not StatusCode.ERROR


async def test_breaking_out_of_the_block_closes_the_generation_at_every_layer():
    rec = Recording()
    stack = Stack(rec)
    got = []
    async with stack.open() as chunks:
        assert isinstance(chunks, ChatStream)
        async for chunk in chunks:
            got.append(chunk.delta_text)
            if len(got) == 2:
                break
        assert rec.ends == [] and stack.slots_held() == [1]  # still open inside the block
    assert got == ["t0 ", "t1 "]
    assert rec.ends == ["closed"]  # the provider's generation was stopped, not left to the GC
    assert stack.slots_held() == [0]  # the admission slot is free again
    [span] = stack.call_spans()  # tracing ended the call as abandoned
    assert span.status.status_code is StatusCode.ERROR and span.attributes["error.type"] == "GeneratorExit"


async def test_an_exception_inside_the_block_closes_the_generation():
    rec = Recording()
    stack = Stack(rec)
    with pytest.raises(KeyError):
        async with stack.open() as chunks:
            await anext(chunks)
            raise KeyError("the caller's own failure")
    assert rec.ends == ["closed"] and stack.slots_held() == [0]
    [span] = stack.call_spans()
    assert span.status.status_code is StatusCode.ERROR and span.attributes["error.type"] == "KeyError"


async def test_cancelling_the_reader_closes_the_generation():
    rec = Recording()
    rec.hold = asyncio.Event()  # the second chunk never comes: the reader waits inside the provider
    stack = Stack(rec)
    first = asyncio.Event()

    async def reader() -> None:
        async with stack.open() as chunks:
            async for _ in chunks:
                first.set()

    task = asyncio.create_task(reader())
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rec.ends == ["closed"] and stack.slots_held() == [0]


async def test_a_failed_attempt_is_closed_before_the_fallback_serves():
    down, up = Recording("down", error=ProviderUnavailable("refused")), Recording("up")
    stack = Stack(down, up)
    async with stack.open() as chunks:
        first = await anext(chunks)
        assert down.ends == ["closed"] and stack.slots_held() == [0, 1]
    assert first.provider == "up" and first.fallback_from == ["down"]
    assert up.ends == ["closed"] and stack.slots_held() == [0, 0]


def _runner(rec: Recording) -> Runner:
    routing = RoutingConfig.model_validate(
        {"providers": {rec.name: {"type": "local"}}, "routes": [{"name": "default", "chain": [rec.name]}]}
    )
    return Runner(routing, {rec.name: rec})


async def test_turn_stream_stays_an_async_iterator_and_closes_when_closed():
    rec = Recording()
    runner = _runner(rec)
    async with runner.turn(conversation_id="c") as turn:
        chunks = [c async for c in turn.stream([{"role": "user", "content": "hi"}])]
        assert chunks[-1].finish_reason == "stop" and rec.ends == ["finished"]
        async with aclosing(turn.stream([{"role": "user", "content": "again"}])) as stream:
            async for _ in stream:
                break
        assert rec.ends == ["finished", "closed"] and runner.gates[rec.name].in_flight == 0


def test_sync_turn_stream_closes_when_the_caller_stops_reading():
    rec = Recording()
    with _runner(rec).sync() as sync, sync.turn() as turn:
        stream = turn.stream([{"role": "user", "content": "hi"}])
        assert next(stream).delta_text == "t0 "
        stream.close()
    assert rec.ends == ["closed"]


def test_wrappers_forward_only_the_provider_interface():
    rec = Recording()
    wrapped = AdmittedProvider(WrapperProvider(rec), AdmissionGate("rec", 1, 0))
    assert wrapped.name == "rec" and wrapped.kind == "local" and wrapped.kv_tokens_in_use is None
    with pytest.raises(AttributeError):
        _ = wrapped.extra  # provider-specific extras are not reachable through a wrapper...
    assert wrapped.unwrap().extra == "only on the bare provider"  # ...only through unwrap()


def test_the_runner_is_what_the_server_expects():
    assert isinstance(_runner(Recording()), ServedRunner)

"""The time before the first token by part (issue 49): the engine's figures (queue, prefix match, each
prefill pass, choosing the first token, the first decode round), the provider's (template, tokenizing,
grammar, history alignment) and the model-call span that carries them; every part is there, none is
negative, and together they come to no more than the time to the first token measured around them."""

from __future__ import annotations

import asyncio
import functools
import os

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from openalice_runner.first_token import PARTS, FirstTokenBreakdown
from openalice_runner.providers.base import CallContext
from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider
from openalice_runner.providers.wrappers.instrumented import InstrumentedProvider
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.tracing import attributes as A
from openalice_runner.types import ChatRequest

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


@functools.cache
def reusing_engine(max_batch: int):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from openalice_runner.engine import Engine

    return Engine.tiny_random(seed=0, max_batch=max_batch, prefix_reuse=True)


def _engine_parts_fit(stats) -> None:
    times = stats.first_token
    assert times.queue_s >= 0 and times.prefix_match_s >= 0 and times.first_token_s >= 0
    assert times.chunks and all(tokens > 0 and seconds > 0 for tokens, seconds in times.chunks)
    # the prompt tokens not served from the cache, each in one pass
    assert sum(tokens for tokens, _ in times.chunks) == stats.prompt_tokens - stats.cached_prompt_tokens
    inside = times.queue_s + times.prefix_match_s + times.prefill_s + times.first_token_s
    assert inside <= stats.ttft_s


@pytest.mark.parametrize("max_batch", [8, 1], ids=["batching", "serial"])
def test_the_engine_times_each_prefill_pass_and_what_came_before(max_batch):
    from openalice_runner.engine.types import SamplingParams

    engine = reusing_engine(max_batch)
    long = [(7 * i) % 4000 + 10 for i in range(700)]  # past one pass of 512 prompt tokens
    first = engine.generate(long, SamplingParams(max_tokens=4))
    _engine_parts_fit(first.stats)
    assert [tokens for tokens, _ in first.stats.first_token.chunks] == [512, 188]
    later = engine.generate(long + first.token_ids + [11, 12, 13], SamplingParams(max_tokens=4))
    assert later.stats.cached_prompt_tokens > 0  # the prefix came from the cache: a short prefill
    _engine_parts_fit(later.stats)
    assert len(later.stats.first_token.chunks) == 1


def test_the_breakdown_keeps_the_parts_in_order_and_refuses_unknown_names():
    breakdown = FirstTokenBreakdown.of({"prefill": 0.5, "template": 0.25, "first_decode": None}, [[3, 0.5]])
    assert breakdown.parts == (("template", 0.25), ("prefill", 0.5))  # PARTS order; None: not measured
    assert breakdown.total_s == 0.75 and breakdown.prefill_tokens == 3
    assert breakdown.as_json() == {"parts_ms": {"template": 250.0, "prefill": 500.0}, "total_ms": 750.0,
                                   "prefill_chunks": [[3, 500.0]]}
    with pytest.raises(ValueError, match="unknown first-token parts"):
        FirstTokenBreakdown.of({"tokenise": 0.1})


def _span_of(exporter: InMemorySpanExporter):
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("chat")]
    return span


async def _streamed(provider, request: ChatRequest, ctx: CallContext) -> None:
    async with provider.stream(request, ctx) as chunks:
        async for _ in chunks:
            pass


def test_the_call_span_carries_every_part_and_they_fit_its_time_to_first_chunk():
    exporter = InMemorySpanExporter()
    tracer = TracerProvider()
    tracer.add_span_processor(SimpleSpanProcessor(exporter))
    local = EmbeddedProvider("local", EmbeddedConfig.model_validate({"type": "local", "prefix_reuse": True}),
                             engine=reusing_engine(8))
    provider = InstrumentedProvider(local, RunnerTelemetry(tracer))
    messages = [{"role": "user", "content": "Read a.py and tell me what it does. " * 8}]
    for step in range(2):  # the second call resends the first's history: its prefix comes from the cache
        request = ChatRequest.model_validate({"messages": messages, "tools": TOOLS, "max_tokens": 8,
                                              "temperature": 0})
        exporter.clear()
        asyncio.run(_streamed(provider, request, CallContext(conversation_id="c", turn_type="tool_call",
                                                             step=step)))
        span = _span_of(exporter)
        attrs = span.attributes
        parts = {p: attrs.get(f"{A.LATENCY_FIRST_TOKEN}.{p}_ms") for p in PARTS}
        # no server here: nothing parsed a body; the engine's first token had text or it did not
        expected = {"template", "tokenize", "grammar", "queue", "prefix_match", "prefill", "first_token",
                    "held_back"}  # a stream: from the first token's arrival to its first chunk
        if step:
            expected.add("history_align")
        assert expected <= {p for p, ms in parts.items() if ms is not None}, parts
        assert parts["parse"] is None
        assert all(ms >= 0 for ms in parts.values() if ms is not None)
        total = attrs[f"{A.LATENCY_FIRST_TOKEN}.total_ms"]
        assert total == pytest.approx(sum(ms for ms in parts.values() if ms is not None), abs=0.01)
        # the parts lie within the span's time to its first chunk (rounded to the µs)
        assert total <= 1000 * attrs[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] + 0.01
        chunks = [e for e in span.events if e.name == A.EVENT_PREFILL_CHUNK]
        assert chunks and sum(e.attributes[A.PREFILL_CHUNK_MS] for e in chunks) == pytest.approx(
            parts["prefill"], abs=0.01 * len(chunks))
        new = attrs[A.GEN_AI_USAGE_INPUT_TOKENS] - attrs[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS]
        assert sum(e.attributes[A.PREFILL_CHUNK_TOKENS] for e in chunks) == new
        if step:
            assert attrs[A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] > 0
        messages = [*messages, {"role": "assistant", "content": "Reading it."},
                    {"role": "user", "content": "Go on."}]

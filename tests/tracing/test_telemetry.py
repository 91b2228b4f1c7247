"""RunnerTelemetry and InstrumentedProvider over the real embedded engine (tiny random model)."""

from __future__ import annotations

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from stand_ins.streams import read_all

from openalice_runner.providers.base import CallContext, ProviderBadRequest
from openalice_runner.providers.local import EmbeddedConfig, EmbeddedProvider
from openalice_runner.providers.wrappers.instrumented import InstrumentedProvider
from openalice_runner.speculation import SpeculationPlan
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.types import ChatRequest


class Recorder:
    def __init__(self, record_content: bool = False) -> None:
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.telemetry = RunnerTelemetry(
            tracer_provider, MeterProvider(metric_readers=[self.reader]), record_content=record_content
        )

    def finished(self):
        return list(self.spans.get_finished_spans())

    def metric_points(self) -> dict[str, list]:
        out: dict[str, list] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    out.setdefault(m.name, []).extend(m.data.data_points)
        return out


@pytest.fixture(scope="module")
def local() -> EmbeddedProvider:
    provider = EmbeddedProvider("local", EmbeddedConfig(type="local", tiny_random=True))
    _ = provider.engine  # load once for the module
    return provider


def _request(text: str = "Say hello", **kw) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": text}], max_tokens=kw.pop("max_tokens", 8), **kw)


async def test_turn_holds_chat_and_tool_spans_with_genai_attributes(local):
    rec = Recorder()
    tel = rec.telemetry
    provider = InstrumentedProvider(local, tel)
    with tel.turn_span("alice", "conv-1", "tool_call") as turn:
        await provider.chat(_request(), CallContext(conversation_id="conv-1", turn_type="tool_call", step=0))
        with tel.tool_span("get_weather", "call_1", step=0, turn_type="tool_call"):
            pass
        chunks = await read_all(provider.stream(_request(), CallContext(turn_type="tool_call", step=1)))
    assert chunks[-1].usage is not None

    spans = {s.name: s for s in rec.finished()}
    agent = spans["invoke_agent alice"]
    assert agent.kind is SpanKind.INTERNAL
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.agent.name"] == "alice"
    assert agent.attributes["gen_ai.conversation.id"] == "conv-1"
    assert agent.attributes["openalice.turn.type"] == "tool_call"

    model = local.engine.model_name
    chats = [s for s in rec.finished() if s.name == f"chat {model}"]
    assert len(chats) == 2
    tool = spans["execute_tool get_weather"]
    for child in [*chats, tool]:
        assert child.parent.span_id == turn.get_span_context().span_id
        assert child.context.trace_id == agent.context.trace_id

    plain, streamed = sorted(chats, key=lambda s: s.start_time)
    a = plain.attributes
    assert plain.kind is SpanKind.CLIENT
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "openalice"
    assert a["gen_ai.request.model"] == model
    assert a["gen_ai.conversation.id"] == "conv-1"
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.usage.input_tokens"] > 0
    assert 0 < a["gen_ai.usage.output_tokens"] <= 8
    # the streamed call sends the same prompt again: all but its last token come from the cache
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert streamed.attributes["gen_ai.usage.cache_read.input_tokens"] == a["gen_ai.usage.input_tokens"] - 1
    assert a["gen_ai.response.finish_reasons"] in (("stop",), ("length",))
    assert a["openalice.provider"] == "local"
    assert a["openalice.turn.type"] == "tool_call"
    assert a["openalice.step"] == 0
    assert a["openalice.speculation.method"] == "off"
    assert a["openalice.speculation.target_passes"] >= 1
    assert a["openalice.latency.ttft_ms"] > 0
    assert a["openalice.latency.decode_ms"] >= 0
    assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a  # content off by default

    s = streamed.attributes
    assert s["gen_ai.request.stream"] is True
    assert s["openalice.step"] == 1
    assert s["gen_ai.response.time_to_first_chunk"] > 0
    assert s["gen_ai.usage.output_tokens"] == chunks[-1].usage.completion_tokens

    t = tool.attributes
    assert t["gen_ai.operation.name"] == "execute_tool"
    assert t["gen_ai.tool.name"] == "get_weather"
    assert t["gen_ai.tool.call.id"] == "call_1"
    assert t["openalice.step"] == 0


async def test_speculation_figures_and_metrics_by_turn_type_and_method(local):
    rec = Recorder()
    provider = InstrumentedProvider(local, rec.telemetry)

    plan = SpeculationPlan("ngram", 3, rule="copy", reason="test", policy_version="v1")
    ctx = CallContext(turn_type="code_edit", step=0, plan=plan)
    text = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat"
    result = await provider.chat(_request(text, max_tokens=24), ctx)
    [span] = rec.finished()
    a = span.attributes
    assert a["openalice.speculation.method"] == "ngram"
    assert a["openalice.speculation.gamma"] == 3
    assert a["openalice.speculation.rule"] == "copy"
    assert a["openalice.speculation.policy_version"] == "v1"
    assert a["openalice.speculation.proposed"] == result.speculation.proposed
    assert a["openalice.speculation.accepted"] == result.speculation.accepted
    assert a["openalice.speculation.target_passes"] == result.speculation.target_passes
    assert "openalice.latency.draft_ms" in a and "openalice.latency.verify_ms" in a

    points = rec.metric_points()
    [duration] = points["gen_ai.client.operation.duration"]
    assert duration.attributes["openalice.turn.type"] == "code_edit"
    assert duration.attributes["openalice.speculation.method"] == "ngram"
    assert duration.attributes["gen_ai.operation.name"] == "chat"
    assert duration.count == 1
    usage = {p.attributes["gen_ai.token.type"]: p for p in points["gen_ai.client.token.usage"]}
    assert usage["output"].sum == result.usage.completion_tokens
    assert usage["input"].sum == result.usage.prompt_tokens
    [tps] = points["openalice.generation.tokens_per_second"]
    assert tps.attributes["openalice.turn.type"] == "code_edit" and tps.sum > 0
    if result.speculation.proposed:
        [accepted] = points["openalice.speculation.accepted_drafts_per_round"]
        assert accepted.count >= 1


async def test_time_to_first_chunk_metric_only_for_streams(local):
    rec = Recorder()
    provider = InstrumentedProvider(local, rec.telemetry)
    await provider.chat(_request(), CallContext())
    assert "gen_ai.client.operation.time_to_first_chunk" not in rec.metric_points()
    await read_all(provider.stream(_request(), CallContext()))
    [ttfc] = rec.metric_points()["gen_ai.client.operation.time_to_first_chunk"]
    assert ttfc.count == 1 and ttfc.sum > 0


async def test_content_recorded_only_when_enabled(local):
    rec = Recorder(record_content=True)
    provider = InstrumentedProvider(local, rec.telemetry)
    await provider.chat(_request("secret plan"), CallContext())
    [span] = rec.finished()
    assert "secret plan" in span.attributes["gen_ai.input.messages"]
    assert "gen_ai.output.messages" in span.attributes


async def test_provider_error_marks_span_and_metric(local):
    rec = Recorder()
    provider = InstrumentedProvider(local, rec.telemetry)
    too_long = "word " * 5000  # past the tiny model's context
    with pytest.raises(ProviderBadRequest):
        await provider.chat(_request(too_long), CallContext())
    [span] = rec.finished()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "400"
    [duration] = rec.metric_points()["gen_ai.client.operation.duration"]
    assert duration.attributes["error.type"] == "400"


async def test_stream_abandoned_by_consumer_ends_span_as_error(local):
    rec = Recorder()
    provider = InstrumentedProvider(local, rec.telemetry)
    async with provider.stream(_request(max_tokens=32), CallContext()) as stream:
        async for _ in stream:
            break
    [span] = rec.finished()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "GeneratorExit"


def test_library_never_installs_global_providers():
    before_tp, before_mp = trace.get_tracer_provider(), metrics.get_meter_provider()
    tel = RunnerTelemetry()
    with tel.turn_span("alice"), tel.tool_span("noop"):
        pass
    assert trace.get_tracer_provider() is before_tp
    assert metrics.get_meter_provider() is before_mp

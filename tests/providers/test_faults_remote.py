"""Remote replies missing a field the runner needs: a bad response, never a quiet default.

A finish reason, a tool call's id and its arguments are required (as its function name already was).
Missing, each is a `ProviderBadResponse` (code bad_response, fallback before the first token), plain
and streamed alike; after the first chunk went out, the stream breaks (`StreamBroken`). Read through
the shared wire readers and the self-hosted pool provider's real HTTP path (SGLang dialect)."""

from __future__ import annotations

import json

import httpx
import pytest
from stand_ins.streams import joined_tool_calls, read_all

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import CallContext, ProviderBadResponse, StreamBroken
from openalice_runner.providers.pools.sglang.provider import SGLangConfig, SGLangProvider
from openalice_runner.types import ChatRequest

REQ = ChatRequest(messages=[{"role": "user", "content": "hi"}])
CALL = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def _without(call: dict, path: str) -> dict:
    call = json.loads(json.dumps(call))
    *parents, last = path.split(".")
    node = call
    for p in parents:
        node = node[p]
    del node[last]
    return call


PLAIN_GAPS = {
    "finish_reason": {"choices": [{"index": 0, "message": {"content": "hello"}}]},
    "finish_reason null": {"choices": [{"index": 0, "message": {"content": "hello"}, "finish_reason": None}]},
    "tool call id": {"choices": [{"message": {"content": None, "tool_calls": [_without(CALL, "id")]},
                                  "finish_reason": "tool_calls"}]},
    "tool call arguments": {"choices": [{"message": {"content": None, "tool_calls": [_without(CALL, "function.arguments")]},
                                         "finish_reason": "tool_calls"}]},
}  # fmt: skip


def _sglang(handler) -> SGLangProvider:
    cfg = SGLangConfig.model_validate({"type": "sglang", "model": "m", "pools": {"off": {"replicas": ["http://s"]}}})
    return SGLangProvider("gpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def _serving(answer):
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/loads":
            return httpx.Response(200, json={"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})
        return answer()

    return handle


@pytest.mark.parametrize("gap", list(PLAIN_GAPS))
async def test_a_plain_reply_missing_a_required_field_is_a_bad_response(gap):
    body = PLAIN_GAPS[gap]
    with pytest.raises(ProviderBadResponse):
        reply = wire.read_response(body, "p")
        wire.tool_calls_of(reply.choices[0].message, "p")
        wire.finish_reason(reply.choices[0].finish_reason, False, "p")
    p = _sglang(_serving(lambda: httpx.Response(200, json=body)))
    with pytest.raises(ProviderBadResponse) as caught:
        await p.chat(REQ, CallContext())
    assert caught.value.fallback_ok and caught.value.code == "bad_response"
    await p.aclose()


def test_a_complete_plain_reply_keeps_what_upstream_sent():
    reply = wire.read_response({"choices": [{"message": {"tool_calls": [CALL]}, "finish_reason": "tool_calls"}]}, "p")
    (call,) = wire.tool_calls_of(reply.choices[0].message, "p")
    assert (call.id, call.function.name, call.function.arguments) == ("call_a", "f", '{"x": 1}')
    assert wire.finish_reason(reply.choices[0].finish_reason, True, "p") == "tool_calls"


def _chunk(delta: dict | None = None, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [choice]})


def _call_piece(**fields) -> dict:
    return {"tool_calls": [{"index": 0, **fields}]}


TEXT = _chunk({"content": "hi"})
STREAM_GAPS = {  # each: the events after the stream's first text chunk (if any)
    "finish_reason": [_chunk({"content": " there"})],
    "tool call id": [_chunk(_call_piece(function={"name": "f", "arguments": "{}"})), _chunk(finish="tool_calls")],
    "tool call name": [_chunk(_call_piece(id="c", function={"arguments": "{}"})), _chunk(finish="tool_calls")],
    "tool call arguments": [_chunk(_call_piece(id="c", function={"name": "f"})), _chunk(finish="tool_calls")],
}


def _sse(lines: list[str]):
    text = "\n\n".join([*lines, "data: [DONE]"]) + "\n\n"
    return lambda: httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("gap", list(STREAM_GAPS))
async def test_a_streamed_reply_missing_a_required_field_is_a_bad_response_before_the_first_token(gap):
    p = _sglang(_serving(_sse(STREAM_GAPS[gap])))
    if gap in ("finish_reason", "tool call arguments"):  # seen at the end, after pieces went out: it breaks
        with pytest.raises(StreamBroken):
            await read_all(p.stream(REQ, CallContext()))
    else:
        with pytest.raises(ProviderBadResponse) as caught:
            await read_all(p.stream(REQ, CallContext()))
        assert caught.value.fallback_ok
    await p.aclose()


@pytest.mark.parametrize("gap", list(STREAM_GAPS))
async def test_a_streamed_reply_missing_a_required_field_breaks_the_stream_after_the_first_token(gap):
    p = _sglang(_serving(_sse([TEXT, *STREAM_GAPS[gap]])))
    got = []
    with pytest.raises(StreamBroken):
        async with p.stream(REQ, CallContext()) as chunks:
            async for chunk in chunks:
                got.append(chunk.delta_text)
    assert got and got[0] == "hi"
    await p.aclose()


def test_the_accumulator_invents_nothing():
    acc = wire.ChunkAccumulator("m", "p")
    acc.feed(wire.read_chunk(json.loads(_chunk({"content": "hi"})[6:]), "p"))
    with pytest.raises(StreamBroken, match="finish_reason"):
        acc.final(wire.SpeculationInfo(method="off"), "p")
    acc = wire.ChunkAccumulator("m", "p")
    with pytest.raises(ProviderBadResponse, match="no id"):
        acc.feed(wire.read_chunk(json.loads(STREAM_GAPS["tool call id"][0][6:]), "p"))


async def test_a_call_the_budget_cut_before_its_arguments_began_ends_in_length_plain_and_streamed():
    """vLLM 0.32 on a forced call whose envelope the budget ends: the call's id and name, then
    finish `length` (seen live, SmolLM2 at max_tokens 16). That is a cut reply, not a malformed one:
    the call with its arguments so far (""), finish `length`; the same gap under `tool_calls` is
    still a bad response (above)."""
    cut = [_chunk(_call_piece(id="c", type="function", function={"name": "f"})), _chunk(finish="length")]
    p = _sglang(_serving(_sse(cut)))
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert joined_tool_calls(chunks) == [{"id": "c", "name": "f", "arguments": ""}]
    assert chunks[-1].finish_reason == "length"
    body = {"choices": [{"message": {"content": None, "tool_calls": [_without(CALL, "function.arguments")]},
                         "finish_reason": "length"}]}  # fmt: skip
    p = _sglang(_serving(lambda: httpx.Response(200, json=body)))
    r = await p.chat(REQ, CallContext())
    assert r.finish_reason == "length" and [(c.id, c.function.name, c.function.arguments) for c in r.tool_calls] == [
        ("call_a", "f", "")]  # fmt: skip
    await p.aclose()


# ---- issue 46 finding 4: what OpenAI's contract has no place for is not read as a clean end


@pytest.mark.parametrize("raw", ["error", "repetition", "abort", "end_turn", "function_call"])
async def test_a_finish_reason_outside_openais_set_is_a_bad_response_naming_it(raw):
    """vLLM 0.32's `error` (a failed request) and `repetition`, an upstream `abort` read outside a
    pool, a foreign API's `end_turn`, or `function_call` without any call: never a quiet `stop`."""
    with pytest.raises(ProviderBadResponse, match=f"finish_reason '{raw}'"):
        wire.finish_reason(raw, saw_tool_calls=False, provider="p")
    if raw == "abort":
        return  # the pools answer `abort` as unavailable (providers/test_sglang.py)
    body = {"choices": [{"message": {"content": "hello"}, "finish_reason": raw}]}
    p = _sglang(_serving(lambda: httpx.Response(200, json=body)))
    with pytest.raises(ProviderBadResponse, match=f"finish_reason '{raw}'") as caught:
        await p.chat(REQ, CallContext())
    assert caught.value.code == "bad_response" and caught.value.fallback_ok
    p = _sglang(_serving(_sse([TEXT, _chunk(finish=raw)])))  # the reason comes after a token went out
    with pytest.raises(StreamBroken, match=f"finish_reason '{raw}'"):
        await read_all(p.stream(REQ, CallContext()))
    p = _sglang(_serving(_sse([_chunk(finish=raw)])))  # nothing went out: another provider may serve
    with pytest.raises(ProviderBadResponse, match=f"finish_reason '{raw}'"):
        await read_all(p.stream(REQ, CallContext()))
    await p.aclose()


@pytest.mark.parametrize("arguments", ["", "  "])
async def test_empty_arguments_on_a_finished_call_are_a_bad_response_naming_the_field(arguments):
    """OpenAI, vLLM 0.32 and SGLang 0.5.23 send "{}" for a function without parameters: "" on a
    call the budget did not cut means the arguments were lost (a cut call keeps "", above)."""
    call = {**CALL, "function": {"name": "f", "arguments": arguments}}
    body = {"choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}]}
    p = _sglang(_serving(lambda: httpx.Response(200, json=body)))
    with pytest.raises(ProviderBadResponse, match=r"tool_calls\.0\.function\.arguments"):
        await p.chat(REQ, CallContext())
    events = [_chunk(_call_piece(id="c", type="function", function={"name": "f", "arguments": arguments})),
              _chunk(finish="tool_calls")]  # fmt: skip
    p = _sglang(_serving(_sse(events)))
    with pytest.raises(StreamBroken, match=r"tool_calls\.0\.function\.arguments empty"):
        await read_all(p.stream(REQ, CallContext()))
    await p.aclose()


def test_a_no_parameter_call_keeps_its_empty_object():
    call = {**CALL, "function": {"name": "f", "arguments": "{}"}}
    reply = wire.read_response({"choices": [{"message": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}, "p")
    (got,) = wire.tool_calls_of(reply.choices[0].message, "p", "tool_calls")
    assert got.function.arguments == "{}"


@pytest.mark.parametrize("usage", ["absent", None, {"prompt_tokens": 3}])
async def test_missing_usage_is_unknown_all_the_way_to_the_reply_and_the_span(usage):
    """OpenAI's `usage` is Optional (ChatCompletion and chunk alike): absent, null or without its
    counts it is unknown, None on the reply, the closing chunk, the JSON and the span, never 0."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from openalice_runner.providers.wrappers.instrumented import InstrumentedProvider
    from openalice_runner.tracing import RunnerTelemetry

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    body = {"id": "x", "choices": [{"message": {"content": "hello"}, "finish_reason": "stop"}]}
    if usage != "absent":
        body["usage"] = usage
    p = InstrumentedProvider(_sglang(_serving(lambda: httpx.Response(200, json=body))),
                             RunnerTelemetry(tracer_provider))  # fmt: skip
    r = await p.chat(REQ, CallContext())
    assert r.content == "hello" and r.usage is None and r.to_openai()["usage"] is None
    events = [TEXT, _chunk(finish="stop")]
    if usage != "absent":
        events.append("data: " + json.dumps({"id": "x", "choices": [], "usage": usage}))
    p = InstrumentedProvider(_sglang(_serving(_sse(events))), RunnerTelemetry(tracer_provider))
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage is None
    finished = spans.get_finished_spans()
    assert len(finished) == 2
    for span in finished:
        assert not any(key.startswith("gen_ai.usage.") for key in span.attributes), dict(span.attributes)
    await p.aclose()


async def test_reported_usage_is_kept_plain_and_streamed():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    body = {"choices": [{"message": {"content": "hello"}, "finish_reason": "stop"}], "usage": usage}
    p = _sglang(_serving(lambda: httpx.Response(200, json=body)))
    r = await p.chat(REQ, CallContext())
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 2, 5)
    events = [TEXT, _chunk(finish="stop"), "data: " + json.dumps({"id": "x", "choices": [], "usage": usage})]
    p = _sglang(_serving(_sse(events)))
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert chunks[-1].usage.completion_tokens == 2
    await p.aclose()


def test_serve_answers_unknown_usage_as_null_never_zeros(tmp_path):
    """Through `serve`: an SGLang pool whose server sends no usage; the plain reply says `usage:
    null`, the stream (include_usage asked) carries no usage figures, and no tokens are counted."""
    from stand_ins.sglang_server import SGLangStandIn
    from support.live_server import LiveServer

    from openalice_runner.runner import Runner
    from openalice_runner.server.app import ServerSettings, create_app

    upstream = SGLangStandIn()
    upstream.faults.no_usage = True
    upstream.start()
    (tmp_path / "providers.yaml").write_text(
        f"providers:\n  gpu: {{type: sglang, model: stand-in/llama-8b, pools: {{off: {{replicas: ['{upstream.url}'], launch: {{tool_call_parser: qwen25}}}}}}}}\n"
        "routes:\n  - {name: default, chain: [gpu]}\n")  # fmt: skip
    (tmp_path / "policy.yaml").write_text("version: 1\ndefault: {method: 'off'}\n")
    runner = Runner.from_config(providers=str(tmp_path / "providers.yaml"), policy=str(tmp_path / "policy.yaml"),
                                telemetry=False)  # fmt: skip
    server = LiveServer(create_app(runner, settings=ServerSettings())).start()
    try:
        url = f"{server.url}/v1/chat/completions"
        r = httpx.post(url, json={"model": "stand-in/llama-8b", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] is None and r.json()["choices"][0]["message"]["content"]
        body = {"model": "stand-in/llama-8b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", url, json=body, timeout=30) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(c.get("usage") is None for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "stop"
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        counted = [line for line in metrics.splitlines() if line.startswith("openalice_tokens_total{")]
        assert counted == []  # nothing counted, not zeros counted
    finally:
        server.stop()
        upstream.stop()

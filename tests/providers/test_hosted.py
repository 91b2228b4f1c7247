"""Hosted provider: the real litellm (openai/... with api_base) against OpenAI-compatible servers on loopback."""

from __future__ import annotations

import time

import pytest
from stand_ins.engines import tiny_engine
from stand_ins.openai_server import OpenAIStandIn, engine_backend
from stand_ins.serve import refused_url
from stand_ins.streams import read_all

from openalice_runner.providers.base import (
    CallContext,
    ProviderBadRequest,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.hosted import HostedConfig, HostedProvider
from openalice_runner.types import ChatRequest

REQ = ChatRequest(messages=[{"role": "user", "content": "hello there"}])
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def server():
    s = OpenAIStandIn().start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv("STAND_IN_API_KEY", "sk-stand-in")


def hosted(url: str, **kw) -> HostedProvider:
    cfg = {"type": "hosted", "model": "openai/stand-in", "api_base": url, "api_key_env": "STAND_IN_API_KEY"}
    cfg.update({"retry_backoff_s": 0.01, **kw})
    return HostedProvider("cloud", HostedConfig.model_validate(cfg))


async def test_chat_through_litellm(server):
    p = hosted(server.url)
    r = await p.chat(
        ChatRequest(messages=[{"role": "user", "content": "hello there"}], max_tokens=2, seed=7),
        CallContext(),
    )
    assert r.content == "You said:" and r.finish_reason == "length"
    assert r.usage.completion_tokens == 2 and r.provider == "cloud" and r.speculation.method == "off"
    assert server.headers[0]["authorization"] == "Bearer sk-stand-in"
    assert server.requests[0]["max_tokens"] == 2 and server.requests[0]["seed"] == 7


async def test_tool_calls_through_litellm(server):
    p = hosted(server.url)
    req = ChatRequest(
        messages=[{"role": "user", "content": "Paris"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    r = await p.chat(req, CallContext())
    assert r.finish_reason == "tool_calls"
    assert r.tool_calls[0].function.name == "get_weather" and '"Paris"' in r.tool_calls[0].function.arguments
    assert server.requests[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


async def test_stream_through_litellm(server):
    p = hosted(server.url)
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert "".join(c.delta_text for c in chunks) == "You said: hello there"
    assert chunks[0].delta.role == "assistant"
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.completion_tokens == 4
    assert server.requests[0]["stream_options"] == {"include_usage": True}


async def test_streamed_tool_call(server):
    p = hosted(server.url)
    req = ChatRequest(messages=[{"role": "user", "content": "Oslo"}], tools=TOOLS, tool_choice="required")
    chunks = await read_all(p.stream(req, CallContext()))
    deltas = [d for c in chunks for d in c.tool_call_deltas]
    assert deltas[0].function.name == "get_weather"
    assert "Oslo" in "".join(d.function.arguments or "" for d in deltas)
    assert chunks[-1].finish_reason == "tool_calls"


async def test_rate_limit_is_retried_honouring_retry_after(server):
    server.faults.fail_next = [429, 429]
    server.faults.retry_after_s = 0.2
    p = hosted(server.url, max_retries=2)
    t0 = time.perf_counter()
    r = await p.chat(REQ, CallContext())
    assert r.content and len(server.requests) == 3
    assert time.perf_counter() - t0 >= 0.4  # two waits of Retry-After 0.2 s
    server.faults.fail_next = [429, 429, 429]
    with pytest.raises(ProviderRateLimited) as info:
        await p.chat(REQ, CallContext())
    assert info.value.retry_after == pytest.approx(0.2) and info.value.fallback_ok


async def test_server_error_is_unavailable_not_retried(server):
    server.faults.fail_next = [500]
    p = hosted(server.url)
    with pytest.raises(ProviderUnavailable) as info:
        await p.chat(REQ, CallContext())
    assert info.value.status_code == 500 and len(server.requests) == 1
    server.faults.fail_next = [503]
    with pytest.raises(ProviderUnavailable):
        _ = await read_all(p.stream(REQ, CallContext()))


async def test_timeouts_are_retried_then_reported(server):
    server.faults.delay_s = 1.0
    p = hosted(server.url, timeout_s=0.3, first_token_timeout_s=0.3, max_retries=1)
    with pytest.raises(ProviderTimeout):
        await p.chat(REQ, CallContext())
    with pytest.raises(ProviderTimeout):
        _ = await read_all(p.stream(REQ, CallContext()))
    assert len(server.requests) == 4  # one retry each


async def test_bad_request_and_missing_key(server, monkeypatch):
    p = hosted(server.url)
    bad = ChatRequest.model_construct(messages=[], model=None, tools=None, tool_choice=None)
    for field in ("temperature", "top_p", "top_k", "seed", "stop", "max_tokens"):
        setattr(bad, field, None)
    with pytest.raises(ProviderBadRequest) as info:
        await p.chat(bad, CallContext())
    assert info.value.status_code == 400 and not info.value.fallback_ok
    monkeypatch.delenv("STAND_IN_API_KEY")
    with pytest.raises(ProviderUnavailable, match="STAND_IN_API_KEY"):
        await p.chat(REQ, CallContext())


async def test_connection_refused_is_unavailable():
    p = hosted(refused_url() + "/v1")
    with pytest.raises(ProviderUnavailable):
        await p.chat(REQ, CallContext())


async def test_stream_cut_after_first_token_is_stream_broken(server):
    server.faults.break_after_chunks = 2
    p = hosted(server.url)
    got = []
    with pytest.raises(StreamBroken):
        async with p.stream(REQ, CallContext()) as chunks:
            async for c in chunks:
                got.append(c.delta_text)
    assert got and "".join(got) == "You said:"


async def test_engine_behind_the_server():
    """The embedded engine's tiny random model answering over HTTP, through litellm."""
    engine = tiny_engine()
    with OpenAIStandIn(backend=engine_backend(engine)) as server:
        p = hosted(server.url)
        r = await p.chat(
            ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4), CallContext()
        )
        expected = engine.generate(engine.render_chat([{"role": "user", "content": "hi"}]), _greedy(4)).text
        assert r.content == expected and r.finish_reason == "length"


def _greedy(n: int):
    from openalice_runner.engine.types import SamplingParams

    return SamplingParams(max_tokens=n)

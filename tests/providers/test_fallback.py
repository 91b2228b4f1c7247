"""Fallback: the next provider serves only when the failure comes before the first token."""

from __future__ import annotations

import pytest
from stand_ins.openai_server import OpenAIStandIn
from stand_ins.serve import refused_url
from stand_ins.sglang_server import SGLangStandIn
from stand_ins.streams import read_all

from openalice_runner.providers.base import (
    CallContext,
    NoProviderAvailable,
    Provider,
    ProviderBadRequest,
    ProviderRateLimited,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.hosted import HostedConfig, HostedProvider
from openalice_runner.providers.pools.sglang.provider import SGLangConfig, SGLangProvider
from openalice_runner.providers.streams import chat_stream
from openalice_runner.providers.wrappers.fallback import FallbackProvider
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult

REQ = ChatRequest(messages=[{"role": "user", "content": "hello there"}])


class Scripted(Provider):
    """Fails (or not) in a given way; counts calls."""

    def __init__(self, name: str, error: Exception | None = None, fail_after: int | None = None) -> None:
        self.name = name
        self.error = error
        self.fail_after = fail_after  # stream: raise after this many chunks
        self.calls = 0

    async def chat(self, request, ctx):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return ChatResult.single(model="m", content=f"from {self.name}", provider=self.name)

    def stream(self, request, ctx):
        return chat_stream(self._stream())

    async def _stream(self):
        self.calls += 1
        for i in range(3):
            if self.error is not None and (self.fail_after or 0) <= i:
                raise self.error
            yield ChatChunk.text("id", "m", f"{self.name}{i} ", role=i == 0)
        yield ChatChunk(id="id", model="m", choices=[{"finish_reason": "stop"}], provider=self.name)


async def test_fallback_before_first_token_names_who_served():
    a = Scripted("a", ProviderUnavailable("connection refused"))
    b = Scripted("b", ProviderRateLimited("429"))
    c = Scripted("c")
    chain = FallbackProvider([a, b, c])
    r = await chain.chat(REQ, CallContext())
    assert r.content == "from c" and r.provider == "c" and r.fallback_from == ["a", "b"]
    chunks = await read_all(chain.stream(REQ, CallContext()))
    assert "".join(x.delta_text for x in chunks) == "c0 c1 c2 "
    assert chunks[0].provider == "c" and chunks[-1].fallback_from == ["a", "b"]


async def test_no_fallback_on_bad_request():
    a, b = Scripted("a", ProviderBadRequest("context too long")), Scripted("b")
    with pytest.raises(ProviderBadRequest):
        await FallbackProvider([a, b]).chat(REQ, CallContext())
    assert b.calls == 0


async def test_no_fallback_after_first_token():
    a, b = Scripted("a", ProviderUnavailable("reset"), fail_after=1), Scripted("b")
    got = []
    with pytest.raises(StreamBroken) as info:
        async with FallbackProvider([a, b]).stream(REQ, CallContext()) as chunks:
            async for x in chunks:
                got.append(x.delta_text)
    assert got == ["a0 "] and b.calls == 0 and info.value.provider == "a"


async def test_everything_failing_is_reported_with_each_error():
    a, b = Scripted("a", ProviderUnavailable("down")), Scripted("b", ProviderUnavailable("down too"))
    with pytest.raises(NoProviderAvailable) as info:
        await FallbackProvider([a, b]).chat(REQ, CallContext())
    assert [e.provider for e in info.value.errors] == ["a", "b"] and "down too" in str(info.value)
    with pytest.raises(NoProviderAvailable):
        _ = await read_all(FallbackProvider([a, b]).stream(REQ, CallContext()))


async def test_real_servers_sglang_down_then_hosted_serves(monkeypatch):
    """SGLang replica refusing connections, then one answering 500: the hosted API serves."""
    monkeypatch.setenv("STAND_IN_API_KEY", "k")
    with SGLangStandIn() as failing, OpenAIStandIn() as cloud:
        failing.faults.fail_next = [500, 500]
        gpu = SGLangProvider(
            "gpu",
            SGLangConfig.model_validate(
                {"type": "sglang", "model": "m", "pools": {"p": {"replicas": [refused_url(), failing.url]}}}
            ),
        )
        hosted = HostedProvider(
            "cloud",
            HostedConfig(type="hosted", model="openai/x", api_base=cloud.url, api_key_env="STAND_IN_API_KEY"),
        )
        chain = FallbackProvider([gpu, hosted])
        r = await chain.chat(REQ, CallContext())
        assert r.provider == "cloud" and r.fallback_from == ["gpu"] and r.content == "You said: hello there"
        chunks = await read_all(chain.stream(REQ, CallContext()))
        assert (
            chunks[-1].provider == "cloud"
            and "".join(x.delta_text for x in chunks) == "You said: hello there"
        )
        # Now the SGLang server breaks mid-stream: reported, and the hosted API is not asked.
        failing.faults.break_after_chunks = 1
        asked = len(cloud.requests)
        gpu.pools["p"][0].down_until = float("inf")  # skip the refusing replica
        with pytest.raises(StreamBroken):
            _ = await read_all(chain.stream(REQ, CallContext()))
        assert len(cloud.requests) == asked
        await chain.aclose()

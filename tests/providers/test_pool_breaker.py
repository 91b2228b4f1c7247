"""A hung replica is skipped (issue 46, finding 3): a real stalled server (a loopback socket that
accepts and never answers) beside a live SGLang stand-in (real HTTP). A call that meets the stalled
one moves on to the live one within its deadline; later calls skip it; a probe after the cool-down
brings it back once it answers (and a failed probe keeps it out, for longer). The cool-downs pass
on the provider's clock, turned by the test; every wait is on an event or a request's end."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from stand_ins.sglang_server import SGLangStandIn
from stand_ins.stalled import StalledServer
from stand_ins.streams import read_all

from openalice_runner.providers.base import CallContext, ProviderTimeout, ProviderUnavailable
from openalice_runner.providers.pools.sglang.provider import SGLangConfig, SGLangProvider
from openalice_runner.types import ChatRequest

REQ = ChatRequest(messages=[{"role": "user", "content": "hello there"}])
DEADLINE_S = 20.0  # the request's deadline: the live replica must have served within it
FIRST_TOKEN_S = 0.5
COOL_DOWN_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def stalled():
    server = StalledServer().start()
    yield server
    if not server._stopping:
        server.stop()


@pytest.fixture
def started():
    servers: list[SGLangStandIn] = []
    yield servers
    for s in servers:
        s.stop()


def provider(replicas: list[str], sent: list[tuple[str, str]]) -> tuple[SGLangProvider, Clock]:
    """Both servers' loads unknown (the stand-in without /v1/loads and /metrics, the stalled one
    silent), read once: the replicas are tried in their listed order, the stalled one first."""
    cfg = SGLangConfig.model_validate({
        "type": "sglang", "model": "stand-in/llama-8b", "pools": {"off": {"replicas": replicas}},
        "first_token_timeout_s": FIRST_TOKEN_S, "load_timeout_s": 0.2, "load_cache_s": 3600, "load_stale_s": 3600,
        "suspect_for_s": COOL_DOWN_S})  # fmt: skip

    async def record(request: httpx.Request) -> None:
        sent.append((f"{request.url.scheme}://{request.url.host}:{request.url.port}", request.url.path))

    p = SGLangProvider("gpu", cfg, client=httpx.AsyncClient(event_hooks={"request": [record]}))
    clock = Clock()
    p.clock = clock
    return p, clock


def chats_to(sent: list[tuple[str, str]], url: str) -> int:
    return sum(1 for where, path in sent if where == url and path == "/v1/chat/completions")


async def test_a_stalled_replica_is_skipped_and_comes_back_after_its_probe(stalled, started):
    live = SGLangStandIn(legacy=True).start()
    started.append(live)
    sent: list[tuple[str, str]] = []
    p, clock = provider([stalled.url, live.url], sent)

    # 1. The stalled replica is tried first; no first token: the call moves on and the live one serves.
    async with asyncio.timeout(DEADLINE_S):
        r = await p.chat(REQ, CallContext())
    assert r.content == "You said: hello there" and len(live.requests) == 1
    assert stalled.wait_chat_requests(1) and chats_to(sent, stalled.url) == 1

    # 2. Later calls skip it, plain and streamed: nothing more is sent its way.
    async with asyncio.timeout(DEADLINE_S):
        await p.chat(REQ, CallContext())
        chunks = await read_all(p.stream(REQ, CallContext()))
    assert "".join(c.delta_text for c in chunks) == "You said: hello there"
    assert len(live.requests) == 3 and chats_to(sent, stalled.url) == 1

    # 3. After the cool-down a probe goes (not a client's call, which the live one serves); the
    #    server still hangs, so the probe fails and the next cool-down is twice as long.
    clock.now += COOL_DOWN_S
    await p.chat(REQ, CallContext())
    await p.wait_probes()
    assert stalled.wait_chat_requests(2) and chats_to(sent, stalled.url) == 2 and len(live.requests) == 4
    clock.now += COOL_DOWN_S  # one cool-down is not enough now
    await p.chat(REQ, CallContext())
    await p.wait_probes()
    assert chats_to(sent, stalled.url) == 2 and len(live.requests) == 5

    # 4. The server comes back on the same port; the next probe finds it answering, and it serves again.
    port = stalled.port
    stalled.stop()
    revived = SGLangStandIn(legacy=True).start(port=port)
    started.append(revived)
    clock.now += COOL_DOWN_S
    await p.chat(REQ, CallContext())
    await p.wait_probes()
    assert len(revived.requests) == 1 and revived.requests[0]["max_tokens"] == 1  # the probe
    async with asyncio.timeout(DEADLINE_S):
        r = await p.chat(REQ, CallContext())
    assert r.content and len(revived.requests) == 2 and len(live.requests) == 6
    await p.aclose()


async def test_a_stream_moves_past_a_stalled_replica(stalled, started):
    live = SGLangStandIn(legacy=True).start()
    started.append(live)
    sent: list[tuple[str, str]] = []
    p, _ = provider([stalled.url, live.url], sent)
    async with asyncio.timeout(DEADLINE_S):
        chunks = await read_all(p.stream(REQ, CallContext()))
    assert "".join(c.delta_text for c in chunks) == "You said: hello there" and len(live.requests) == 1
    assert stalled.wait_chat_requests(1)
    await p.aclose()


async def test_a_pool_whose_replicas_are_all_suspect_refuses_at_once_saying_when_it_probes(stalled):
    sent: list[tuple[str, str]] = []
    p, clock = provider([stalled.url], sent)
    with pytest.raises(ProviderTimeout, match="no first token within 0.5 s"):
        await p.chat(REQ, CallContext())
    clock.now += 10
    with pytest.raises(ProviderUnavailable, match="suspect") as refused:
        await p.chat(REQ, CallContext())
    assert not isinstance(refused.value, ProviderTimeout) and refused.value.retry_after == COOL_DOWN_S - 10
    assert chats_to(sent, stalled.url) == 1  # the refusal sent nothing
    await p.aclose()

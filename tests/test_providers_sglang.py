"""SGLang provider against stand-in SGLang servers on loopback (real HTTP, SGLang's fields)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from stand_ins.serve import refused_url
from stand_ins.sglang_server import SGLangStandIn
from stand_ins.streams import read_all

from openalice_runner.providers.base import (
    CallContext,
    ProviderBadRequest,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.sglang import SGLangConfig, SGLangProvider, parse_prometheus_sum
from openalice_runner.types import ChatRequest

REQ = ChatRequest(messages=[{"role": "user", "content": "hello there"}])


@pytest.fixture
def servers():
    started: list[SGLangStandIn] = []

    def make(**kwargs) -> SGLangStandIn:
        s = SGLangStandIn(**kwargs).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def provider(pools: dict, **kw) -> SGLangProvider:
    cfg = SGLangConfig.model_validate({"type": "sglang", "model": "stand-in/llama-8b", "pools": pools, **kw})
    return SGLangProvider("gpu", cfg)


def decision(method="eagle", pool=None, gamma=3):
    return SimpleNamespace(method=method, gamma=gamma, pool=pool, rule="r1", policy_version="v1")


async def test_least_loaded_replica_serves_whatever_load_endpoint_it_has(servers):
    busy = servers(method="eagle", running=7)  # /v1/loads
    idle = servers(method="eagle", running=1, legacy=True)  # /get_load only (0.5.x)
    metrics = servers(method="eagle", running=3, metrics_only=True)  # /metrics only
    p = provider({"eagle3": {"method": "eagle", "replicas": [busy.url, idle.url, metrics.url]}})
    result = await p.chat(REQ, CallContext())
    assert len(idle.requests) == 1 and not busy.requests and not metrics.requests
    assert [r.load_endpoint for r in p.pools["eagle3"]] == ["v1_loads", "get_load", "metrics"]
    assert [r.running for r in p.pools["eagle3"]] == [7, 1, 3]
    assert result.content == "You said: hello there" and result.provider == "gpu"
    # The idle replica gets busier: the next request goes elsewhere once the cache expires.
    idle.running = 10
    p.config.load_cache_s = 0
    await p.chat(REQ, CallContext())
    assert len(metrics.requests) == 1
    await p.aclose()


async def test_load_is_cached_briefly(servers):
    s = servers(running=2)
    p = provider({"off": {"replicas": [s.url]}}, load_cache_s=60)
    for _ in range(3):
        await p.chat(REQ, CallContext())
    assert s.load_reads == 1
    load = await p.current_load()
    assert load.batch_size == 2 and load.queue_depth == 0
    await p.aclose()


async def test_policy_decision_picks_the_pool(servers):
    eagle, ngram, plain = servers(method="eagle"), servers(method="ngram"), servers()
    p = provider(
        {
            "eagle3": {"method": "eagle", "replicas": [eagle.url], "launch": {"num_draft_tokens": 4}},
            "ngram": {"method": "ngram", "replicas": [ngram.url], "launch": {"num_draft_tokens": 8}},
            "plain": {"method": "off", "replicas": [plain.url]},
        },
        default_pool="plain",
    )
    r = await p.chat(REQ, CallContext(decision=decision(pool="ngram", method="ngram")))
    assert len(ngram.requests) == 1 and r.speculation.pool == "ngram" and r.speculation.gamma == 7
    r = await p.chat(REQ, CallContext(decision=decision(method="eagle")))  # no pool: by method
    assert len(eagle.requests) == 1 and r.speculation.method == "eagle"
    r = await p.chat(REQ, CallContext())  # no decision: default pool
    assert len(plain.requests) == 1 and r.speculation.method == "off"
    await p.aclose()


async def test_speculation_figures_come_from_meta_info(servers):
    s = servers(method="eagle", num_draft_tokens=4, accept_length=2.0)
    p = provider({"eagle3": {"method": "eagle", "replicas": [s.url], "launch": {"num_draft_tokens": 4}}})
    req = ChatRequest(messages=[{"role": "user", "content": "one two three four five six seven"}])
    r = await p.chat(req, CallContext(decision=decision()))
    assert s.requests[0]["return_meta_info"] is True and s.requests[0]["model"] == "stand-in/llama-8b"
    spec = r.speculation
    # 9 completion tokens at 2.0 per verify pass -> 5 passes, 15 proposed, 4 accepted.
    assert r.usage.completion_tokens == 9
    assert (spec.target_passes, spec.proposed, spec.accepted) == (5, 15, 4)
    assert spec.acceptance_rate == pytest.approx(4 / 15) and spec.accept_length == pytest.approx(9 / 5)
    assert (spec.rule, spec.policy_version, spec.pool) == ("r1", "v1", "eagle3")
    assert r.outcome.accepted == 4 and r.outcome.method == "eagle"  # for policy.observe
    await p.aclose()


async def test_tool_calls_and_sampling_fields_pass_through(servers):
    s = servers()
    p = provider({"off": {"replicas": [s.url]}})
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    req = ChatRequest(
        messages=[{"role": "user", "content": "Paris"}],
        tools=tools,
        tool_choice="required",
        top_k=5,
        seed=1,
        stop="x",
    )
    r = await p.chat(req, CallContext())
    assert r.finish_reason == "tool_calls" and r.tool_calls[0].function.name == "get_weather"
    sent = s.requests[0]
    assert (sent["top_k"], sent["seed"], sent["stop"], sent["tool_choice"]) == (5, 1, ["x"], "required")
    await p.aclose()


async def test_stream_follows_sglang_sse(servers):
    s = servers(method="ngram")
    p = provider({"ngram": {"method": "ngram", "replicas": [s.url], "launch": {"num_draft_tokens": 8}}})
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert "".join(c.delta_text for c in chunks) == "You said: hello there"
    assert chunks[0].delta.role == "assistant"  # the empty role opener is folded into the first token
    assert all(c.delta_text for c in chunks[:-1])
    final = chunks[-1]
    assert final.finish_reason == "stop" and final.usage.completion_tokens == 4
    assert final.speculation.method == "ngram" and final.provider == "gpu"
    assert s.requests[0]["stream"] is True and "return_meta_info" not in s.requests[0]
    await p.aclose()


async def test_refused_or_failing_replica_is_skipped(servers):
    good = servers(running=5)
    bad = servers(running=0)
    bad.faults.fail_next = [503]
    p = provider({"off": {"replicas": [refused_url(), bad.url, good.url]}})
    r = await p.chat(REQ, CallContext())
    assert r.content and len(good.requests) == 1 and len(bad.requests) == 1
    await p.aclose()


async def test_errors_are_typed(servers):
    s = servers()
    p = provider({"off": {"replicas": [s.url]}}, first_token_timeout_s=0.3)
    s.faults.fail_next = [400]
    with pytest.raises(ProviderBadRequest) as info:
        await p.chat(REQ, CallContext())
    assert info.value.status_code == 400 and "injected" in str(info.value)
    s.faults.fail_next = [500]
    with pytest.raises(ProviderUnavailable):
        await p.chat(REQ, CallContext())
    s.faults.first_token_delay_s = 1.0
    with pytest.raises(ProviderTimeout):
        await p.chat(REQ, CallContext())
    with pytest.raises(ProviderTimeout):
        _ = await read_all(p.stream(REQ, CallContext()))
    s.faults.first_token_delay_s = 0
    s.faults.abort = True
    with pytest.raises(ProviderUnavailable, match="aborted"):
        await p.chat(REQ, CallContext())
    await p.aclose()
    dead = provider({"off": {"replicas": [refused_url()]}})
    with pytest.raises(ProviderUnavailable, match="no replica"):
        await dead.chat(REQ, CallContext())
    await dead.aclose()


async def test_stream_breaks_after_first_token_are_stream_broken(servers):
    s = servers()
    p = provider({"off": {"replicas": [s.url]}})
    s.faults.break_after_chunks = 2
    got = []
    with pytest.raises(StreamBroken):
        async with p.stream(REQ, CallContext()) as chunks:
            async for c in chunks:
                got.append(c.delta_text)
    assert got == ["You", " said:"]
    s.faults.break_after_chunks = None
    s.faults.error_after_chunks = 1
    with pytest.raises(StreamBroken, match="injected stream error"):
        _ = await read_all(p.stream(REQ, CallContext()))
    s.faults.error_after_chunks = 0  # error event before any token: not broken, unavailable
    with pytest.raises(ProviderUnavailable):
        _ = await read_all(p.stream(REQ, CallContext()))
    await p.aclose()


async def test_concurrent_requests_spread_over_replicas(servers):
    a, b = servers(), servers()
    a.faults.first_token_delay_s = b.faults.first_token_delay_s = 0.2
    p = provider({"off": {"replicas": [a.url, b.url]}}, load_cache_s=60)
    await asyncio.gather(*(p.chat(REQ, CallContext()) for _ in range(4)))
    assert len(a.requests) == 2 and len(b.requests) == 2  # in-flight counting between load reads
    await p.aclose()


def test_config_and_launch_args():
    with pytest.raises(ValueError, match="default_pool"):
        SGLangConfig.model_validate(
            {"type": "sglang", "model": "m", "pools": {"a": {"replicas": ["http://x"]}}, "default_pool": "b"}
        )
    with pytest.raises(ValueError, match="http"):
        SGLangConfig.model_validate({"type": "sglang", "model": "m", "pools": {"a": {"replicas": ["x:1"]}}})
    cfg = SGLangConfig.model_validate(
        {
            "type": "sglang",
            "model": "m",
            "pools": {
                "e": {
                    "method": "eagle",
                    "replicas": ["http://x/"],
                    "launch": {
                        "draft_model_path": "d",
                        "num_steps": 3,
                        "eagle_topk": 1,
                        "num_draft_tokens": 4,
                    },
                }
            },
        }
    )
    assert cfg.pools["e"].replicas == ["http://x"]
    assert cfg.pools["e"].launch_args() == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
    ]  # fmt: skip


def test_prometheus_parsing():
    text = (
        "# HELP sglang:num_running_reqs x\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 2.0\n'
        "sglang:num_running_reqs_offline_batch 9\n"
    )
    assert parse_prometheus_sum(text, "sglang:num_running_reqs") == 5.0
    assert parse_prometheus_sum(text, "sglang:num_queue_reqs") is None

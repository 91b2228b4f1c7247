"""SGLang provider against stand-in SGLang servers on loopback (real HTTP, SGLang's fields)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from stand_ins.serve import refused_url
from stand_ins.sglang_server import SGLangStandIn
from stand_ins.streams import read_all

from openalice_runner.policies.adaptive import request_alpha
from openalice_runner.providers.base import (
    CallContext,
    ProviderBadRequest,
    ProviderBadResponse,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.pools.sglang.provider import (
    SGLangConfig,
    SGLangProvider,
    parse_prometheus_sum,
)
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
    # load_timeout_s: the stand-ins answer at once, but a loaded CI host can stall them past the 0.5 s default
    cfg = SGLangConfig.model_validate(
        {"type": "sglang", "model": "stand-in/llama-8b", "pools": pools, "load_timeout_s": 30, **kw}
    )
    return SGLangProvider("gpu", cfg)


def decision(method="eagle", pool=None, gamma=3, gamma_range=None):
    return SimpleNamespace(
        method=method, gamma=gamma, pool=pool, rule="r1", policy_version="v1", gamma_range=gamma_range
    )


EAGLE3 = {"algorithm": "EAGLE3", "draft_model_path": "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B"}


async def test_least_loaded_replica_serves_whatever_load_endpoint_it_has(servers):
    busy = servers(method="eagle", running=7)  # /v1/loads
    idle = servers(method="eagle", running=1, legacy=True, enable_metrics=True)  # /metrics only
    metrics = servers(method="eagle", running=3, legacy=True, enable_metrics=True)
    blind = servers(method="eagle", running=0, legacy=True)  # no load endpoint: unknown load, last
    p = provider({"eagle3": {"replicas": [blind.url, busy.url, idle.url, metrics.url], "launch": EAGLE3}})
    result = await p.chat(REQ, CallContext())
    assert len(idle.requests) == 1 and not busy.requests and not metrics.requests and not blind.requests
    assert [r.load_endpoint for r in p.pools["eagle3"]] == [None, "v1_loads", "metrics", "metrics"]
    assert [r.running for r in p.pools["eagle3"]] == [None, 7, 1, 3]
    assert result.content == "You said: hello there" and result.provider == "gpu"
    # The idle replica gets busier: the next request goes elsewhere once the cache expires.
    idle.running = 10
    p.config.load_cache_s = p.config.load_stale_s = 0
    await p.chat(REQ, CallContext())
    assert len(metrics.requests) == 1
    await p.aclose()


async def test_the_stand_in_is_no_more_lenient_than_sglang(servers):
    s = servers()
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{s.url}/get_load")).status_code == 404  # no such route in 0.5.23
        assert (await client.get(f"{s.url}/metrics")).status_code == 404  # needs --enable-metrics


async def test_load_is_cached_briefly(servers):
    s = servers(running=2)
    p = provider({"off": {"replicas": [s.url]}}, load_cache_s=60)
    for _ in range(3):
        await p.chat(REQ, CallContext())
    assert s.load_reads == 1
    load = await p.current_load()
    assert load.batch_size == 2 and load.queue_depth == 0
    await p.aclose()


async def test_a_replica_never_read_is_read_however_long_readings_are_kept(servers):
    """A reading kept longer than the machine has been up (monotonic time starts near 0 in a fresh
    container) still does not stand in for one never taken."""
    s = servers(running=4)
    p = provider({"off": {"replicas": [s.url]}}, load_cache_s=1e9, load_stale_s=1e9)
    assert (await p.current_load()).batch_size == 4 and s.load_reads == 1
    await p.aclose()


async def test_a_stale_reading_is_used_at_once_and_read_again_in_the_background(servers):
    """Between load_cache_s and load_stale_s a request does not wait for /metrics: it uses the
    reading it has, and the reading is renewed in the background once the call has ended (not
    beside it, where the scrape would slow the server's work on it); past load_stale_s it waits."""
    s = servers(running=2)
    p = provider({"off": {"replicas": [s.url]}}, load_cache_s=0, load_stale_s=60)
    await p.chat(REQ, CallContext())  # never read: waited for
    assert s.load_reads == 1 and p._background_refresh is None
    s.running = 5
    assert (await p.current_load()).batch_size == 2  # the reading it had, not a wait for a new one
    assert s.load_reads == 1  # nor a read beside the call
    await p.chat(REQ, CallContext())  # its end starts the read
    await p._background_refresh
    assert s.load_reads == 2 and p.load().batch_size == 5
    p.config.load_stale_s = 0  # past the stale window: waited for again
    s.running = 1
    assert (await p.current_load()).batch_size == 1
    await p.aclose()


async def test_policy_decision_picks_the_pool(servers):
    eagle, ngram, plain = servers(method="eagle"), servers(method="ngram"), servers()
    p = provider(
        {
            "eagle3": {"replicas": [eagle.url], "launch": {**EAGLE3, "num_draft_tokens": 4}},
            "ngram": {"replicas": [ngram.url], "launch": {"algorithm": "NGRAM", "num_draft_tokens": 8}},
            "plain": {"replicas": [plain.url]},  # algorithm NONE
        },
        default_pool="plain",
    )
    r = await p.chat(REQ, CallContext(plan=decision(pool="ngram", method="ngram")))
    assert len(ngram.requests) == 1 and r.speculation.pool == "ngram" and r.speculation.gamma == 7
    r = await p.chat(REQ, CallContext(plan=decision(method="eagle")))  # no pool: by method
    assert len(eagle.requests) == 1 and r.speculation.method == "eagle"
    r = await p.chat(REQ, CallContext())  # no decision: default pool
    assert len(plain.requests) == 1 and r.speculation.method == "off"
    await p.aclose()


async def test_speculation_figures_come_from_sglext(servers):
    s = servers(method="eagle", num_draft_tokens=4, tokens_per_pass=2.0)
    p = provider({"eagle3": {"replicas": [s.url], "launch": {**EAGLE3, "num_draft_tokens": 4}}})
    req = ChatRequest(messages=[{"role": "user", "content": "one two three four five six seven"}])
    r = await p.chat(req, CallContext(plan=decision()))
    assert (
        s.requests[0]["return_spec_tokens_details"] is True and s.requests[0]["model"] == "stand-in/llama-8b"
    )
    assert "spec_num_correct_drafts" in s.responses[0]["sglext"]["spec_tokens_details"]  # 0.5.23 names
    spec = r.speculation
    # 9 completion tokens at 2.0 per verify pass -> 5 passes, 15 proposed, 4 accepted.
    assert r.usage.completion_tokens == 9
    assert (spec.target_passes, spec.proposed, spec.accepted) == (5, 15, 4)
    assert spec.acceptance_rate == pytest.approx(4 / 15) and spec.tokens_per_pass == pytest.approx(9 / 5)
    assert (spec.rule, spec.policy_version, spec.pool) == ("r1", "v1", "eagle3")
    assert r.outcome.accepted == 4 and r.outcome.method == "eagle"  # for policy.observe
    # SGLang grows the histogram only to the largest k seen ([1, 4] here): padded to γ + 1 = 4
    assert s.responses[0]["sglext"]["spec_tokens_details"]["spec_correct_drafts_histogram"] == [1, 4]
    assert r.outcome.accept_length_histogram == (1, 4, 0, 0) and not r.outcome.gamma_varies
    await p.aclose()


async def test_streamed_turns_carry_speculation_figures(servers):
    s = servers(method="eagle", num_draft_tokens=4, tokens_per_pass=2.0)
    p = provider({"eagle3": {"replicas": [s.url], "launch": {**EAGLE3, "num_draft_tokens": 4}}})
    req = ChatRequest(messages=[{"role": "user", "content": "one two three four five six seven"}])
    chunks = await read_all(p.stream(req, CallContext(plan=decision())))
    assert s.requests[0]["return_spec_tokens_details"] is True and "return_meta_info" not in s.requests[0]
    ext = [e for e in s.responses if "sglext" in e]
    assert len(ext) == 1 and ext[0]["choices"] == []  # its own chunk, after the finish chunk
    final = chunks[-1]
    assert (final.speculation.target_passes, final.speculation.proposed, final.speculation.accepted) == (
        5,
        15,
        4,
    )
    assert final.outcome.accept_length_histogram == (1, 4, 0, 0) and final.outcome.tokens_per_pass == 1.8
    await p.aclose()


async def test_adaptive_pool_reports_varying_gamma(servers):
    s = servers(method="eagle", num_draft_tokens=4, tokens_per_pass=2.0)
    launch = {**EAGLE3, "num_steps": 3, "adaptive": True, "max_running_requests": 8}
    p = provider({"eagle3": {"replicas": [s.url], "launch": launch}})
    req = ChatRequest(messages=[{"role": "user", "content": "one two three four five six seven"}])
    # the deciding rule is auto over 1..5: its slot's candidates reach 5, the most one round can draft
    r = await p.chat(req, CallContext(plan=decision(gamma_range=(1, 5))))
    o = r.outcome
    assert o.gamma_varies and o.gamma == 5 and o.accept_length_histogram == (1, 4, 0, 0, 0, 0)
    # α from accepted drafts per verify round, never 4/15 against the launch step count
    assert request_alpha(o) == pytest.approx(4 / (4 + 5))
    await p.aclose()


async def test_sglang_0_5_23_reply_shapes_parse(servers):
    """Hand-written 0.5.23 bodies (protocol.py): tool calls with `index`, `content: ""`, dict
    arguments, unknown extras; the speculation counters in meta_info under the new names."""
    body = {
        "id": "abc", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{
            "index": 0,
            "message": {
                "role": "assistant", "content": "", "reasoning_content": None,
                "tool_calls": [
                    {"id": "call_1", "index": 0, "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "index": 1, "type": "function",
                     "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
                ],
            },
            "logprobs": None, "finish_reason": "tool_calls", "matched_stop": None, "hidden_future_field": 1,
            "meta_info": {"id": "abc", "spec_verify_ct": 4, "spec_accept_length": 2.5, "spec_accept_rate": 0.5,
                          "spec_num_correct_drafts": 6, "spec_num_proposed_drafts": 12,
                          "spec_correct_drafts_histogram": [1, 1, 1, 1]},
        }],
        "usage": {"prompt_tokens": 5, "total_tokens": 15, "completion_tokens": 10, "prompt_tokens_details": None,
                  "reasoning_tokens": 0, "completion_tokens_details": None},
        "metadata": {"weight_version": "default"},
    }  # fmt: skip
    p = provider(
        {"eagle3": {"replicas": ["http://sglang"], "launch": {**EAGLE3, "num_draft_tokens": 4}}}
    )
    r = p._result(httpx.Response(200, json=body), "eagle3", CallContext())
    assert [tc.function.name for tc in r.tool_calls] == ["get_weather", "get_time"]
    assert r.tool_calls[1].function.arguments == '{"tz": "CET"}' and r.tool_calls[0].id == "call_1"
    assert r.finish_reason == "tool_calls" and r.content is None
    assert (r.outcome.accepted, r.outcome.proposed, r.outcome.target_passes) == (6, 12, 4)
    assert r.outcome.accept_length_histogram == (1, 1, 1, 1)
    await p.aclose()


@pytest.mark.parametrize(
    "body",
    [
        {"id": "x", "choices": []},  # no choice
        {"id": "x", "choices": [{"index": 0, "finish_reason": "stop"}]},  # no message
        {
            "choices": [
                {"message": {"content": "", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}}
            ]
        },
        {"choices": [{"message": {"content": 5}}]},  # content of the wrong type
        [1, 2],
    ],
)
async def test_malformed_upstream_body_falls_back_before_the_first_token(body, monkeypatch):
    from stand_ins.openai_server import OpenAIStandIn

    from openalice_runner.providers.hosted import HostedConfig, HostedProvider
    from openalice_runner.providers.wrappers.fallback import FallbackProvider

    p = provider({"off": {"replicas": ["http://sglang"]}})
    with pytest.raises(ProviderBadResponse) as info:
        p._result(httpx.Response(200, json=body), "off", CallContext())
    assert info.value.fallback_ok and info.value.code == "bad_response"
    await p.aclose()

    # over HTTP: a replica answering 200 with such a body, then the chain's next provider serves
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/loads":
            return httpx.Response(200, json={"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})
        return httpx.Response(200, json=body)

    sg = SGLangProvider(
        "gpu",
        SGLangConfig.model_validate(
            {"type": "sglang", "model": "m", "pools": {"off": {"replicas": ["http://sglang"]}}}
        ),
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
    )
    monkeypatch.setenv("STAND_IN_API_KEY", "k")
    with OpenAIStandIn() as cloud:
        hosted = HostedProvider(
            "cloud",
            HostedConfig(type="hosted", model="openai/x", api_base=cloud.url, api_key_env="STAND_IN_API_KEY"),
        )
        r = await FallbackProvider([sg, hosted]).chat(REQ, CallContext())
        assert r.provider == "cloud" and r.fallback_from == ["gpu"]
    await sg.aclose()


async def test_malformed_stream_event_falls_back_before_the_first_token_and_breaks_after():
    events = [
        'data: {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "hi"}}]}',
        'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": 7}}]}',
    ]

    def handler(first_bad: bool):
        def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/loads":
                return httpx.Response(200, json={"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})
            lines = events[1:] if first_bad else events
            return httpx.Response(
                200, text="\n\n".join(lines) + "\n\n", headers={"content-type": "text/event-stream"}
            )

        return handle

    cfg = SGLangConfig.model_validate(
        {"type": "sglang", "model": "m", "pools": {"off": {"replicas": ["http://s"]}}}
    )
    early = SGLangProvider("gpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(handler(True))))
    with pytest.raises(ProviderBadResponse, match="content"):
        _ = await read_all(early.stream(REQ, CallContext()))
    late = SGLangProvider("gpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(handler(False))))
    got = []
    with pytest.raises(StreamBroken):
        async with late.stream(REQ, CallContext()) as chunks:
            async for c in chunks:
                got.append(c.delta_text)
    assert got == ["hi"]
    await early.aclose()
    await late.aclose()


async def test_tool_calls_and_sampling_fields_pass_through(servers):
    s = servers(tool_call_parser="llama3")
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
        parallel_tool_calls=False,
        top_k=5,
        seed=1,
        stop="x",
    )
    r = await p.chat(req, CallContext())
    assert r.finish_reason == "tool_calls" and r.tool_calls[0].function.name == "get_weather"
    got = s.responses[0]["choices"][0]["message"]
    assert got["content"] == "" and got["tool_calls"][0]["index"] == 0  # SGLang's shape
    assert r.content is None  # OpenAI's: no text beside the call
    sent = s.requests[0]
    assert (sent["top_k"], sent["seed"], sent["stop"], sent["tool_choice"]) == (5, 1, ["x"], "required")
    assert sent["parallel_tool_calls"] is False
    # streamed: the call's pieces keep their index
    chunks = await read_all(p.stream(req, CallContext()))
    calls = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert {tc.index for tc in calls} == {0} and calls[0].function.name == "get_weather"
    assert chunks[-1].finish_reason == "tool_calls"
    await p.aclose()


async def test_allowed_tools_go_to_sglang_as_the_allowed_tools_under_the_plain_mode(servers):
    # SGLang 0.5.23's ChatCompletionRequest refuses tool_choice {"type": "allowed_tools"}
    s = servers(tool_call_parser="llama3")
    p = provider({"off": {"replicas": [s.url]}})
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_time", "get_weather")]
    choice = {"type": "allowed_tools",
              "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    r = await p.chat(ChatRequest(messages=[{"role": "user", "content": "Paris"}], tools=tools, tool_choice=choice),
                     CallContext())  # fmt: skip
    assert r.tool_calls[0].function.name == "get_weather"
    sent = s.requests[0]
    assert sent["tool_choice"] == "required" and [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    await p.aclose()


async def test_without_a_tool_call_parser_sglang_answers_text(servers):
    s = servers()  # launched without --tool-call-parser
    p = provider({"off": {"replicas": [s.url]}})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = await p.chat(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required"),
                     CallContext())  # fmt: skip
    assert not r.tool_calls and r.finish_reason == "stop" and "get_weather" in r.content
    await p.aclose()


async def test_stream_follows_sglang_sse(servers):
    s = servers(method="ngram")
    p = provider({"ngram": {"replicas": [s.url], "launch": {"algorithm": "NGRAM", "num_draft_tokens": 8}}})
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert "".join(c.delta_text for c in chunks) == "You said: hello there"
    assert chunks[0].delta.role == "assistant"  # the empty role opener is folded into the first token
    assert all(c.delta_text for c in chunks[:-1])
    final = chunks[-1]
    assert final.finish_reason == "stop" and final.usage.completion_tokens == 4
    assert final.speculation.method == "ngram" and final.provider == "gpu"
    assert s.requests[0]["stream"] is True and "return_meta_info" not in s.requests[0]
    assert s.responses[0]["choices"][0]["delta"] == {
        "reasoning_content": None,
        "role": "assistant",
        "content": "",
    }
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
    await p.aclose()  # its one replica is suspect now (providers/test_pool_breaker.py): a fresh provider each
    fresh = provider({"off": {"replicas": [s.url]}}, first_token_timeout_s=0.3)
    with pytest.raises(ProviderTimeout):
        _ = await read_all(fresh.stream(REQ, CallContext()))
    await fresh.aclose()
    s.faults.first_token_delay_s = 0
    s.faults.abort = True
    p = provider({"off": {"replicas": [s.url]}}, first_token_timeout_s=0.3)
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


def test_config():
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
                    "replicas": ["http://x/"],
                    "launch": {
                        "algorithm": "EAGLE3",
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
    assert cfg.pools["e"].gamma_for() == 3 and cfg.pools["e"].method == "eagle"
    assert cfg.pools["e"].gamma_for(decision(gamma=5)) == 3  # the launch's γ, whatever the rule says
    adaptive = {"replicas": ["http://x"], "launch": {**EAGLE3, "num_steps": 3, "adaptive": True}}
    cfg = SGLangConfig.model_validate({"type": "sglang", "model": "m", "pools": {"e": adaptive}})
    assert cfg.pools["e"].adaptive
    assert cfg.pools["e"].gamma_for(decision(gamma=2, gamma_range=(1, 7))) == 7  # the most one round can draft
    assert cfg.pools["e"].gamma_for(decision(gamma=4)) == 4  # a fixed rule: its γ
    assert cfg.pools["e"].gamma_for() == 3  # no decision: the launch's num_steps
    # a pool whose launch leaves γ to the rules takes the deciding rule's
    rules_gamma = {"replicas": ["http://x"], "launch": {"algorithm": "NGRAM"}}
    cfg = SGLangConfig.model_validate({"type": "sglang", "model": "m", "pools": {"n": rules_gamma}})
    assert cfg.pools["n"].gamma_for(decision(method="ngram", gamma=6)) == 6


def test_prometheus_parsing():
    text = (
        "# HELP sglang:num_running_reqs x\n"
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 3.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 2.0\n'
        "sglang:num_running_reqs_offline_batch 9\n"
    )
    assert parse_prometheus_sum(text, "sglang:num_running_reqs") == 5.0
    assert parse_prometheus_sum(text, "sglang:num_queue_reqs") is None


async def test_a_conversation_stays_on_its_replica_while_its_load_is_within_bounds(servers):
    a, b, c = servers(), servers(), servers()
    p = provider({"off": {"replicas": [a.url, b.url, c.url]}}, load_cache_s=0, load_stale_s=0)
    for _ in range(4):
        await p.chat(REQ, CallContext(conversation_id="conv-1"))
    served = [s for s in (a, b, c) if s.requests]
    assert len(served) == 1 and len(served[0].requests) == 4  # affinity, not least-loaded spreading
    # other conversations hash elsewhere (a rendezvous order per key)
    for k in range(12):
        await p.chat(REQ, CallContext(conversation_id=f"c{k}"))
    assert sum(1 for s in (a, b, c) if s.requests) >= 2
    # its replica gets busy past the bound (mean load x 1.5 + 1): the conversation moves
    served[0].running = 30
    n = len(served[0].requests)
    await p.chat(REQ, CallContext(conversation_id="conv-1"))
    assert len(served[0].requests) == n
    await p.aclose()


async def test_affinity_off_is_least_loaded_alone(servers):
    a, b = servers(running=3), servers(running=0)
    p = provider({"off": {"replicas": [a.url, b.url]}}, affinity_load_factor=0, load_cache_s=0, load_stale_s=0)
    for k in range(4):
        await p.chat(REQ, CallContext(conversation_id=f"c{k}"))
    assert len(b.requests) == 4 and not a.requests
    await p.aclose()


async def test_unknown_load_is_not_batch_one_and_is_logged_once(servers, caplog):
    from openalice_runner.policies import PolicyStore, RequestContext
    from openalice_runner.providers.wrappers.policy import PolicyProvider

    blind = servers(legacy=True)  # neither /v1/loads nor /metrics
    p = provider(
        {"ngram": {"replicas": [blind.url], "launch": {"algorithm": "NGRAM", "num_draft_tokens": 5}},
         "off": {"replicas": [blind.url]}},
        load_cache_s=0,
        load_stale_s=0,
    )  # fmt: skip
    policy = PolicyStore.from_text(
        "version: 1\nrules:\n"
        "  - {name: small, match: {batch_size: {min: 1, max: 2}}, method: ngram, gamma: 4, pool: ngram}\n"
        "  - {name: big, match: {batch_size: {min: 3}}, method: off, pool: off}\n"
        "default: {method: ngram, gamma: 4, pool: ngram}\n"
    )
    deciding = PolicyProvider(p, policy)
    with caplog.at_level("WARNING", logger="openalice_runner.providers.pools.replicas"):
        for _ in range(3):
            r = await deciding.chat(REQ, CallContext())
            assert r.speculation.rule == "big" and r.speculation.pool == "off"  # the conservative rule
    assert p.load().unknown and p.load().batch_size is None
    said = [m for m in caplog.messages if "load unknown" in m]
    assert len(said) == 2  # once per replica (two pool entries of the same server), not per read
    # a rule may match the unknown batch size itself
    policy = PolicyStore.from_text(
        "version: 1\nrules:\n"
        "  - {name: small, match: {batch_size: {min: 1, max: 2}}, method: ngram, gamma: 4, pool: ngram}\n"
        "  - {name: unknown, match: {batch_size: {min: 9, unknown: true}}, method: ngram, gamma: 2, pool: ngram}\n"
        "  - {name: big, match: {batch_size: {min: 3}}, method: off, pool: off}\n"
        "default: {method: off}\n"
    )
    r = await PolicyProvider(p, policy).chat(REQ, CallContext())
    assert r.speculation.rule == "unknown"
    assert policy.decide(RequestContext(batch_size=None)).reason.startswith("batch size unknown")
    await p.aclose()


async def test_the_policy_sees_the_batch_of_the_pool_its_rule_names(servers):
    from openalice_runner.policies import PolicyStore
    from openalice_runner.providers.wrappers.policy import PolicyProvider

    busy, idle = servers(method="ngram", running=5), servers(running=0)
    p = provider(
        {"ngram": {"replicas": [busy.url], "launch": {"algorithm": "NGRAM", "num_draft_tokens": 5}},
         "plain": {"replicas": [idle.url]}},
        load_cache_s=0,
        load_stale_s=0,
    )  # fmt: skip
    policy = PolicyStore.from_text(
        "version: 1\nrules:\n"
        "  - {name: small, match: {batch_size: {min: 1, max: 4}}, method: ngram, gamma: 4, pool: ngram}\n"
        "  - {name: big, match: {batch_size: {min: 5}}, method: ngram, gamma: 1, pool: ngram}\n"
        "default: {method: off, pool: plain}\n"
    )
    # the provider-wide figure is the idle plain replica's (batch 1); the ngram pool runs 5 (batch 6)
    r = await PolicyProvider(p, policy).chat(REQ, CallContext())
    assert r.speculation.rule == "big" and len(busy.requests) == 1
    await p.aclose()

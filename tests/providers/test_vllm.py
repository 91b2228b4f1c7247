"""vLLM provider against bodies recorded from a real vLLM 0.32.0 server (tests/contract/vllm_0_32_bodies.json,
SmolLM2-135M on CPU, an n-gram pool launched with `--per-request-spec-decode-metrics summary`),
replayed over httpx's mock transport; tests/providers/test_vllm_live.py runs the same paths against live servers."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import jinja2
import pytest
from locations import REPO, TESTS
from stand_ins.streams import read_all

from openalice_runner.policies.adaptive import request_alpha
from openalice_runner.providers.base import CallContext, ProviderBadRequest, ProviderUnavailable, StreamBroken
from openalice_runner.providers.config import RoutingConfigError, load_routing_text
from openalice_runner.providers.embedded.tool_format import render_fallback_messages
from openalice_runner.providers.pools import streaming as pool_streaming
from openalice_runner.providers.pools.vllm.provider import VLLMConfig, VLLMProvider
from openalice_runner.types import ChatRequest

BODIES = json.loads((TESTS / "contract" / "vllm_0_32_bodies.json").read_text())
REQ = ChatRequest(messages=[{"role": "user", "content": "Repeat this code exactly: def add(a, b): ..."}])
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def decision(pool="ngram", method="ngram", gamma=5):
    return SimpleNamespace(method=method, gamma=gamma, pool=pool, rule="r", policy_version="v", gamma_range=None)


class Replay:
    """A vLLM replica answering with recorded bodies; `requests` keeps what it was sent."""

    def __init__(self, answer: str = "plain", *, status: int = 200, metrics: str | None = None) -> None:
        self.answer, self.status = answer, status
        self.metrics = BODIES["metrics"] if metrics is None else metrics
        self.requests: list[dict] = []
        self.headers: list[httpx.Headers] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=self.metrics) if self.metrics else httpx.Response(404)
        body = json.loads(request.content)
        self.requests.append(body)
        self.headers.append(request.headers)
        if self.status != 200:
            recorded = BODIES[self.answer]
            return httpx.Response(recorded["status"], json=recorded["body"])
        if body.get("stream"):
            key = self.answer + ("_stream" if self.answer != "plain" else "")
            key = "stream" if self.answer == "plain" else key
            text = "\n\n".join(BODIES[key]) + "\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=BODIES[self.answer])


def provider(pools: dict, replay: Replay, **kw) -> VLLMProvider:
    cfg = VLLMConfig.model_validate({"type": "vllm", "model": "smollm2", "pools": pools, **kw})
    return VLLMProvider("cpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(replay)))


async def test_plain_reply_carries_vllms_per_request_speculation_figures():
    replay = Replay()
    p = provider({"ngram": {"replicas": ["http://v1"], "launch": NGRAM}}, replay)
    r = await p.chat(REQ, CallContext(plan=decision()))
    spec = BODIES["plain"]["metrics"]["speculative_decoding"]
    assert r.content == BODIES["plain"]["choices"][0]["message"]["content"]
    assert (r.outcome.accepted, r.outcome.proposed) == (spec["num_accepted_draft_tokens"], spec["num_draft_tokens"])
    assert r.outcome.accept_length_histogram == tuple(spec["acceptance_histogram"])
    assert r.speculation.pool == "ngram" and r.speculation.method == "ngram" and r.speculation.gamma == 5
    assert r.outcome.target_passes >= spec["num_spec_steps"]
    assert r.outcome.tokens_per_pass == pytest.approx(spec["mean_acceptance_length"])
    # adaptive γ learns α from vLLM's counts: every step here proposed the full 5, so the per-round
    # estimate (a step that accepted fewer than 5 stopped at a rejection); else accepted / proposed
    hist = spec["acceptance_histogram"]
    accepted = spec["num_accepted_draft_tokens"]
    assert sum(hist) * 5 == spec["num_draft_tokens"]
    assert request_alpha(r.outcome) == pytest.approx(accepted / (accepted + sum(hist[:-1])))
    sent = replay.requests[0]
    assert sent["model"] == "smollm2" and "return_spec_tokens_details" not in sent  # no SGLang fields
    await p.aclose()


async def test_streamed_reply_takes_the_figures_from_the_final_usage_chunk():
    replay = Replay()
    p = provider({"ngram": {"replicas": ["http://v1"], "launch": NGRAM}}, replay)
    chunks = await read_all(p.stream(REQ, CallContext(plan=decision())))
    last = json.loads(BODIES["stream"][-2][5:])
    assert last["choices"] == [] and "speculative_decoding" in last["metrics"]
    spec = last["metrics"]["speculative_decoding"]
    final = chunks[-1]
    assert final.outcome.accepted == spec["num_accepted_draft_tokens"] > 0
    assert final.outcome.proposed == spec["num_draft_tokens"]
    assert final.usage.completion_tokens == last["usage"]["completion_tokens"]
    assert replay.requests[0]["stream_options"] == {"include_usage": True}  # else vLLM sends no figures
    await p.aclose()


async def test_the_conversation_id_goes_upstream_for_a_gateway_to_key_on():
    """smg's consistent_hashing keys on a header it is told to read: the runner sends the
    conversation id as X-OpenAlice-Conversation-Id, plain and streamed, and nothing without one."""
    replay = Replay()
    p = provider({"ngram": {"replicas": ["http://v1"], "launch": NGRAM}}, replay)
    await p.chat(REQ, CallContext(plan=decision(), conversation_id="conv-7"))
    await read_all(p.stream(REQ, CallContext(plan=decision(), conversation_id="conv-7")))
    await p.chat(REQ, CallContext(plan=decision()))
    assert [h.get("x-openalice-conversation-id") for h in replay.headers] == ["conv-7", "conv-7", None]
    await p.aclose()


async def test_tool_calls_plain_and_streamed():
    replay = Replay("tool_call")
    p = provider({"plain": {"replicas": ["http://v1"], "launch": {"tool_call_parser": "hermes"}}}, replay)
    req = ChatRequest(messages=[{"role": "user", "content": "Paris?"}], tools=TOOLS, tool_choice="required")
    r = await p.chat(req, CallContext())
    assert r.finish_reason == "tool_calls" and r.tool_calls[0].function.name == "get_weather"
    json.loads(r.tool_calls[0].function.arguments)
    chunks = await read_all(p.stream(req, CallContext()))
    calls = [tc for c in chunks for tc in c.delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and chunks[-1].finish_reason == "tool_calls"
    assert replay.requests[0]["tool_choice"] == "required" and replay.requests[0]["tools"] == TOOLS
    await p.aclose()


async def test_allowed_tools_go_as_the_allowed_tools_under_the_plain_mode():
    replay = Replay("tool_call")
    p = provider({"plain": {"replicas": ["http://v1"]}}, replay)
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required",
              "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}  # fmt: skip
    tools = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    await p.chat(ChatRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice), CallContext())
    sent = replay.requests[0]
    assert sent["tool_choice"] == "required" and [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    await p.aclose()


@pytest.mark.parametrize(("recorded", "param"), [("error_tool_choice", "tool_choice"), ("error_validation", "max_tokens")])
async def test_vllm_refusals_are_400s_naming_the_field(recorded, param):
    p = provider({"plain": {"replicas": ["http://v1"]}}, Replay(recorded, status=400))
    with pytest.raises(ProviderBadRequest) as info:
        await p.chat(REQ, CallContext())
    assert info.value.status_code == 400 and info.value.param == param and info.value.message.startswith(param)
    with pytest.raises(ProviderBadRequest):
        await read_all(p.stream(REQ, CallContext()))
    await p.aclose()


async def test_load_from_vllm_metrics_capped_by_max_num_seqs():
    metrics = 'vllm:num_requests_running{engine="0",model_name="m"} 3.0\nvllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
    p = provider({"plain": {"replicas": ["http://v1"], "launch": {"max_num_seqs": 4}}}, Replay(metrics=metrics))
    load = await p.current_load()
    assert (load.batch_size, load.queue_depth, load.max_batch, load.unknown) == (3, 2, 4, False)
    recorded = provider({"plain": {"replicas": ["http://v1"]}}, Replay())
    assert (await recorded.current_load()).batch_size == 0  # the recorded idle server
    blind = provider({"plain": {"replicas": ["http://v1"]}}, Replay(metrics=""))
    assert (await blind.current_load()).unknown
    for q in (p, recorded, blind):
        await q.aclose()


async def test_a_gateway_fronted_pool_reads_its_workers_load_and_sends_to_the_gateway():
    """`load_from`: requests go to the pool's one replica (an smg gateway), the load the policy sees
    is the workers' own (vLLM's /metrics; smg's are its own), and the gateway's /metrics are never read."""
    seen: list[tuple[str, str]] = []
    workers = {"w1": 'vllm:num_requests_running{engine="0",model_name="m"} 5.0\n',
               "w2": 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
                     'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'}
    replay = Replay()

    def route(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.path))
        if request.url.host in workers:
            return httpx.Response(200, text=workers[request.url.host])
        return replay(request)

    cfg = VLLMConfig.model_validate({"type": "vllm", "model": "smollm2", "pools": {"plain": {
        "replicas": ["http://gw"], "load_from": ["http://w1", "http://w2"], "launch": {"max_num_seqs": 8}}}})
    p = VLLMProvider("cpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(route)))
    load = await p.current_load()
    assert (load.batch_size, load.queue_depth, load.max_batch, load.unknown) == (2, 1, 8, False)  # w2, the least loaded
    r = await p.chat(REQ, CallContext(plan=decision(pool="plain", method="off", gamma=0)))
    assert r.content
    assert ("gw", "/v1/chat/completions") in seen and ("gw", "/metrics") not in seen
    assert {host for host, path in seen if path == "/metrics"} == {"w1", "w2"}
    await p.aclose()


async def test_a_gateway_pool_counts_the_runners_own_calls_on_top_of_its_workers_load():
    """Issue 46, finding 5: the workers' readings are the pool's load, so the runner's own calls in
    flight through the gateway count on them (on the least-loaded worker, where a reading says a
    request goes), as they do on a replica of a pool without a gateway, until the next reading."""
    workers = {"w1": 'vllm:num_requests_running{engine="0",model_name="m"} 5.0\n',
               "w2": 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'}
    replay = Replay()
    arrived, release = asyncio.Event(), asyncio.Event()

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.host in workers:
            return httpx.Response(200, text=workers[request.url.host])
        arrived.set()
        await release.wait()  # the gateway holds the call: it is in flight
        return replay(request)

    cfg = VLLMConfig.model_validate({"type": "vllm", "model": "smollm2", "load_cache_s": 3600, "load_stale_s": 3600,
                                     "pools": {"plain": {"replicas": ["http://gw"], "load_from": ["http://w1", "http://w2"]}}})  # fmt: skip
    p = VLLMProvider("cpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(route)))
    assert (await p.current_load()).batch_size == 2  # w2, the least loaded
    call = asyncio.create_task(p.chat(REQ, CallContext(plan=decision(pool="plain", method="off", gamma=0))))
    await arrived.wait()
    assert p.pool_load("plain").batch_size == 3 and p.load().batch_size == 3  # w2's 2 and the runner's own call
    release.set()
    assert (await call).content
    assert p.pool_load("plain").batch_size == 2  # done: counted no more
    await p.aclose()


def test_load_from_urls_are_checked_like_replicas():
    with pytest.raises(ValueError, match="must be an http"):
        VLLMConfig.model_validate({"type": "vllm", "model": "m", "pools": {"plain": {
            "replicas": ["http://gw"], "load_from": ["w1:8000"]}}})


async def test_a_replica_failing_before_the_first_token_falls_over_and_a_broken_stream_is_reported():
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=BODIES["metrics"])
        calls.append(request.url.host)
        if request.url.host == "dead":
            raise httpx.ConnectError("connection refused")
        if request.url.host == "cut":  # the server dies after two chunks
            text = "\n\n".join(BODIES["stream"][:3]) + "\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        return Replay()(request)

    cfg = VLLMConfig.model_validate({"type": "vllm", "model": "smollm2", "affinity_load_factor": 0,
                                     "pools": {"p": {"replicas": ["http://dead", "http://ok"]}}})  # fmt: skip
    p = VLLMProvider("cpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    chunks = await read_all(p.stream(REQ, CallContext()))
    assert calls[:2] == ["dead", "ok"] and chunks[-1].finish_reason
    cfg = VLLMConfig.model_validate({"type": "vllm", "model": "smollm2", "pools": {"p": {"replicas": ["http://cut"]}}})
    cut = VLLMProvider("cpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    with pytest.raises(StreamBroken):
        await read_all(cut.stream(REQ, CallContext()))
    dead = VLLMProvider("cpu", VLLMConfig.model_validate(
        {"type": "vllm", "model": "m", "pools": {"p": {"replicas": ["http://dead"]}}}),
        client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))  # fmt: skip
    with pytest.raises(ProviderUnavailable, match="no replica"):
        await dead.chat(REQ, CallContext())
    for q in (p, cut, dead):
        await q.aclose()


def test_routing_file_checks_vllm_launch_settings_where_they_sit():
    text = (
        "providers:\n  cpu:\n    type: vllm\n    model: m\n    pools:\n      e:\n        replicas: [http://x]\n"
        "        launch:\n          method: eagle3\n          prompt_lookup_min: 2\n"
        "routes:\n  - name: d\n    chain: [cpu]\n"
    )
    with pytest.raises(RoutingConfigError) as info:
        load_routing_text(text, "r.yaml")
    problems = [str(p) for p in info.value.problems]
    assert any(p.startswith("r.yaml:9:") and "needs draft_model" in p for p in problems)
    assert any(p.startswith("r.yaml:10:11") and "prompt_lookup_min" in p for p in problems)


def test_shipped_tool_template_renders_what_the_embedded_engine_renders():
    """providers/templates/smollm2-hermes-tools.jinja: SmolLM2's ChatML with the embedded engine's
    fallback tool form (tool_format.py), so vLLM's hermes parser reads the calls it asks for."""
    env = jinja2.Environment()
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    template = env.from_string((REPO / "providers" / "templates" / "smollm2-hermes-tools.jinja").read_text())
    convs = [
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
         {"role": "tool", "tool_call_id": "c1", "content": "22 C"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    ]  # fmt: skip
    for messages in convs:
        got = template.render(messages=messages, tools=TOOLS, add_generation_prompt=True)
        want = "".join(
            f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            for m in render_fallback_messages(messages, TOOLS, "auto")
        )
        assert got == want + "<|im_start|>assistant\n"
    plain = template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


class SocketReplica:
    """A vLLM replica on a real loopback socket, HTTP/1.1 keep-alive, the recorded stream sent in
    chunked encoding: `chat_connections` counts the connections that carried a chat request.
    `hold_open` sends `[DONE]` and then never ends the body, as a misbehaving server might."""

    def __init__(self, *, hold_open: bool = False) -> None:
        self.hold_open = hold_open
        self.chat_connections = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for writer in self.writers:  # a held-open body would keep its handler waiting
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        counted = False
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                lines = head.decode().split("\r\n")
                headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:] if ": " in line)}
                await reader.readexactly(int(headers.get("content-length", "0")))
                if " /metrics " in lines[0]:
                    text = BODIES["metrics"].encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
                    continue
                if not counted:
                    counted, self.chat_connections = True, self.chat_connections + 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                for event in BODIES["stream"]:
                    data = (event + "\n\n").encode()
                    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
                if self.hold_open:
                    await asyncio.Event().wait()
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def socket_provider(url: str) -> VLLMProvider:
    cfg = VLLMConfig.model_validate({"type": "vllm", "model": "smollm2",
                                     "pools": {"ngram": {"replicas": [url], "launch": NGRAM}}})  # fmt: skip
    return VLLMProvider("cpu", cfg)


async def test_a_streamed_call_hands_its_connection_back_for_the_next_call():
    """The stream stops reading at `[DONE]`; unless the body is then read to its end, httpx closes
    the connection and every streamed call pays a new connect (measured: a quarter of a millisecond
    of the runner's CPU a call, and a TCP handshake). Three calls, one connection."""
    replica = SocketReplica()
    async with replica as url:
        p = socket_provider(url)
        for _ in range(3):
            chunks = await read_all(p.stream(REQ, CallContext(plan=decision())))
            assert chunks[-1].outcome.accepted > 0
        await p.aclose()
    assert replica.chat_connections == 1


async def test_a_body_held_open_past_done_ends_the_stream_within_the_drain_bound(monkeypatch):
    """A server that sends `[DONE]` and never ends its body costs the client DRAIN_S, not a hang;
    that connection is given up and the next call opens another."""
    monkeypatch.setattr(pool_streaming, "DRAIN_S", 0.05)
    replica = SocketReplica(hold_open=True)
    async with replica as url:
        p = socket_provider(url)
        for _ in range(2):
            async with asyncio.timeout(5):
                chunks = await read_all(p.stream(REQ, CallContext(plan=decision())))
            assert chunks[-1].finish_reason
        await p.aclose()
    assert replica.chat_connections == 2

"""Live tier: `type: vllm` pools on real vLLM 0.32.0 CPU servers (SmolLM2-135M), through Runner and serve.

Two servers start once per session from the lines `vllm args` prints for providers/vllm-cpu.yaml's
pools (ports and the model folder filled in): an n-gram pool (γ by batch size) and a plain pool. The
runner routes by policies/vllm-cpu-split.yaml (copy-heavy turns to n-gram, chat to plain at every
batch size: routing by turn type is what is tested; it launches the same pools as the shipped
policies/vllm-cpu.yaml, whose chat goes to n-gram at batch 1-2). A third, one-sequence server is
started for the fault tests and killed there.
Skipped, saying why, only where the side venv (scripts/peer-vllm-cpu.sh) is not usable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import vllm_servers
import yaml
from locations import REPO
from stand_ins.processes import free_port, wait_http
from tiers import needs_install

from openalice_runner import Runner
from openalice_runner.bench import gateway_affinity
from openalice_runner.policies import PolicyStore
from openalice_runner.pool_checks import find_pool, vllm_pool_launch
from openalice_runner.providers.base import CallContext
from openalice_runner.providers.config import load_routing_file
from openalice_runner.types import ChatRequest

pytestmark = [
    pytest.mark.slow,
    needs_install(vllm_servers.venv_problem()),
]

POLICY = REPO / "policies" / "vllm-cpu-split.yaml"
# strict: vLLM 0.32 pins a call's arguments to the tool's schema only for a strict tool (OpenAI's
# semantics; its --tool-strict-level auto); a forced call to a loose tool is only the envelope, and
# SmolLM2 may fill it with any JSON: on an Intel CPU in bf16 it copied the schema itself into the
# arguments until the 200-token budget cut it (finish length). A loose forced call cut by the budget
# has its own test below.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
          "strict": True, "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"], "additionalProperties": False}}}]  # fmt: skip
CODE = "".join(f"def f{i}(a, b):\n    return a * {i} + b\n\n" for i in range(12))
COPY = [{"role": "user", "content": f"Repeat this code exactly, nothing else:\n\n{CODE}"}]
CHAT = [{"role": "user", "content": "Tell me about the sea in two sentences."}]


def routing_text(ports: dict[str, int], model: Path, extra: dict | None = None) -> str:
    """providers/vllm-cpu.yaml with this session's ports, the model folder and the template's path."""
    data = yaml.safe_load((REPO / "providers" / "vllm-cpu.yaml").read_text())
    cpu = data["providers"]["cpu"]
    cpu["load_cache_s"] = cpu["load_stale_s"] = 0  # the tests read the servers' load at every decision
    for name, pool in cpu["pools"].items():
        pool["replicas"] = [f"http://127.0.0.1:{ports[name]}"]
        pool["launch"]["model_path"] = str(model)
        pool["launch"]["chat_template"] = str(vllm_servers.TEMPLATE)
        pool["launch"]["max_model_len"] = 2048
    data["providers"].pop("local")
    data["routes"] = [{"name": "default", "chain": ["cpu"]}]
    if extra:
        data["providers"].update(extra["providers"])
        data["routes"] = extra["routes"]
    return yaml.safe_dump(data, sort_keys=False)


class Pools:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = vllm_servers.ensure_model_dir()
        self.ports = {"ngram": free_port(), "plain": free_port()}
        self.routing = tmp / "providers.yaml"
        self.routing.write_text(routing_text(self.ports, self.model))
        policy = PolicyStore.from_file(POLICY).policy
        routing = load_routing_file(self.routing)
        self.servers: dict[str, vllm_servers.VLLMServer] = {}
        for name, port in self.ports.items():
            args = vllm_pool_launch(find_pool(routing, name, dialect="vllm"), policy).args
            self.servers[name] = vllm_servers.VLLMServer(args, name=name, port=port).start(tmp)
        for server in self.servers.values():
            server.wait_ready()

    def runner(self) -> Runner:
        return Runner.from_config(self.routing, POLICY, telemetry=False)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def pools(tmp_path_factory):
    started = Pools(tmp_path_factory.mktemp("vllm"))
    print("vLLM start-up (s):", {k: round(s.started_s or 0, 1) for k, s in started.servers.items()})
    yield started
    started.stop()


async def test_plain_and_streamed_chat_go_to_the_plain_pool(pools):
    async with pools.runner() as runner:
        r = await runner.chat(ChatRequest(messages=CHAT, max_tokens=24), CallContext(turn_type="chat"))
        assert r.content and r.speculation.pool == "plain" and r.speculation.method == "off"
        assert r.provider == "cpu" and r.usage.completion_tokens > 0
        text, final = "", None
        async with runner.stream(ChatRequest(messages=CHAT, max_tokens=24), CallContext(turn_type="chat")) as chunks:
            async for c in chunks:
                text += c.delta_text or ""
                final = c if c.finish_reason else final
        assert text and final is not None and final.speculation.pool == "plain"
        assert final.usage.completion_tokens > 0


async def test_a_repeated_prompt_reports_its_cached_tokens_plain_and_streamed(pools):
    """The pools run with --enable-prompt-tokens-details (`vllm args`): usage says how much of a
    prompt came from vLLM's prefix cache, and the runner passes it on."""
    request = ChatRequest(messages=COPY, max_tokens=4)
    async with pools.runner() as runner:
        first = await runner.chat(request, CallContext(turn_type="chat"))
        again = await runner.chat(request, CallContext(turn_type="chat"))
        final = None
        async with runner.stream(request, CallContext(turn_type="chat")) as chunks:
            async for c in chunks:
                final = c if c.finish_reason else final
    assert first.usage.prompt_tokens_details is not None  # reported, whatever the cache held before
    for usage in (again.usage, final.usage):
        assert usage.prompt_tokens_details is not None
        assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


async def test_a_tenants_prefix_is_cached_for_that_tenant_alone(pools):
    """Each tenant's requests carry its `cache_salt` (issue 48): vLLM then finds none of another tenant's
    prefix in its cache (cached_tokens 0), while the same tenant's second request finds its own (the
    control). A prompt of its own, so nothing cached by other tests counts."""
    request = ChatRequest(messages=[{"role": "user", "content": f"Tenants, {time.time_ns()}:\n\n{CODE}"}], max_tokens=2)
    async with pools.runner() as runner:
        first = await runner.chat(request, CallContext(turn_type="chat", tenant="alpha"))
        other = await runner.chat(request, CallContext(turn_type="chat", tenant="beta"))
        same = await runner.chat(request, CallContext(turn_type="chat", tenant="alpha"))
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens > 200
    assert other.usage.prompt_tokens_details.cached_tokens == 0, other.usage
    assert same.usage.prompt_tokens_details.cached_tokens >= 128, same.usage


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
async def test_tool_calls_parse(pools, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    req = ChatRequest(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
                      tool_choice=tool_choice, max_tokens=200, temperature=0)  # fmt: skip
    async with pools.runner() as runner:
        r = await runner.chat(req, CallContext(turn_type="tool_call"))
        calls = []
        async with runner.stream(req, CallContext(turn_type="tool_call")) as chunks:
            async for c in chunks:
                calls += c.delta.tool_calls or []
                final = c
    assert r.speculation.pool == "ngram"  # tool_call is a copy-heavy turn
    if choice == "auto":  # the model may answer in words; whatever it chose parses
        for tc in r.tool_calls or []:
            assert tc.function.name == "get_weather" and isinstance(json.loads(tc.function.arguments), dict)
        assert r.tool_calls or r.content
        return
    assert r.finish_reason == "tool_calls" and r.tool_calls[0].function.name == "get_weather"
    assert isinstance(json.loads(r.tool_calls[0].function.arguments), dict)
    assert final.finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    assert isinstance(json.loads("".join(c.function.arguments or "" for c in calls)), dict)


async def test_a_loose_forced_call_cut_by_the_budget_ends_in_length_plain_and_streamed(pools):
    """A forced call to a non-strict tool, cut inside its envelope: vLLM's reply is passed on as it
    is, finish `length` both ways (plain: its text, the call unparsed; streamed: the call's deltas
    so far), never a broken stream or an invented call."""
    loose = [{"type": "function", "function": {k: v for k, v in TOOLS[0]["function"].items() if k != "strict"}}]
    req = ChatRequest(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=loose,
                      tool_choice="required", max_tokens=8, temperature=0)  # fmt: skip
    async with pools.runner() as runner:
        r = await runner.chat(req, CallContext(turn_type="tool_call"))
        calls, final = [], None
        async with runner.stream(req, CallContext(turn_type="tool_call")) as chunks:
            async for c in chunks:
                calls += c.delta.tool_calls or []
                final = c if c.finish_reason else final
    assert r.finish_reason == "length" and r.usage.completion_tokens == 8
    assert all(tc.function.name == "get_weather" for tc in r.tool_calls or [])
    assert final is not None and final.finish_reason == "length"
    assert all(d.function.name in (None, "get_weather") for d in calls if d.function)


async def test_response_format_json_schema(pools):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    req = ChatRequest(messages=[{"role": "user", "content": "Name a city as JSON."}], max_tokens=40, temperature=0,
                      response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})  # fmt: skip
    async with pools.runner() as runner:
        r = await runner.chat(req, CallContext(turn_type="chat"))
    assert isinstance(json.loads(r.content)["city"], str)


async def test_copy_heavy_turn_on_the_ngram_pool_counts_match_vllms_counters(pools):
    ngram = pools.servers["ngram"]
    before = {k: ngram.metric(f"vllm:spec_decode_num_{k}_total") for k in ("draft_tokens", "accepted_tokens")}
    async with pools.runner() as runner:
        r = await runner.chat(ChatRequest(messages=COPY, max_tokens=80, temperature=0), CallContext(turn_type="code_edit"))
        after = {k: ngram.metric(f"vllm:spec_decode_num_{k}_total") for k in ("draft_tokens", "accepted_tokens")}
        s = r.speculation
        assert s.pool == "ngram" and s.method == "ngram" and s.rule == "copy-heavy-small-batch"
        assert s.proposed > 0 and s.accepted > 0
        assert (s.proposed, s.accepted) == (
            after["draft_tokens"] - before["draft_tokens"],
            after["accepted_tokens"] - before["accepted_tokens"],
        )
        # streamed: the figures ride the final usage chunk
        before = after
        async with runner.stream(ChatRequest(messages=COPY, max_tokens=80, temperature=0),
                                 CallContext(turn_type="code_edit")) as chunks:  # fmt: skip
            final = [c async for c in chunks][-1]
        after = {k: ngram.metric(f"vllm:spec_decode_num_{k}_total") for k in ("draft_tokens", "accepted_tokens")}
        assert final.speculation.proposed == after["draft_tokens"] - before["draft_tokens"] > 0
        assert final.speculation.accepted == after["accepted_tokens"] - before["accepted_tokens"] > 0


def _occupy(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    """n long streams held open on a server until `stop` (each reads until the event is set).

    Sampled at temperature 1 so the text does not settle into a loop that n-gram drafting runs
    through at many tokens a pass: greedy, a fast machine finished all three before the request
    under test was decided."""

    def hold() -> None:
        body = {"model": "smollm2", "messages": CHAT, "max_tokens": 1900, "ignore_eos": True, "stream": True,
                "temperature": 1.0, "seed": 7}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as resp:
            for _ in resp.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


async def _until(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)  # the servers' own counters: no event to wait on


async def test_n_concurrent_requests_make_the_policy_see_batch_n_from_vllms_metrics(pools):
    ngram = pools.servers["ngram"]
    stop = threading.Event()
    async with pools.runner() as runner:  # built first: its start-up is not spent while the streams run
        threads = _occupy(ngram.url, 3, stop)  # with this request: 4 running, the 3-4 rule
        try:
            await _until(lambda: ngram.metric("vllm:num_requests_running") >= 3, "3 running requests")
            r = await runner.chat(ChatRequest(messages=COPY, max_tokens=16), CallContext(turn_type="code_edit"))
            # the precondition held through the decision: the three streams are still open
            assert all(t.is_alive() for t in threads), "a held stream ended before the request was decided"
            # γ 3: what the pool's per-batch table has its servers draft at batch 3-4
            assert r.speculation.rule == "copy-heavy-mid-batch" and r.speculation.gamma == 3
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    await _until(lambda: ngram.metric("vllm:num_requests_running") == 0, "the streams to end")
    async with pools.runner() as runner:
        r = await runner.chat(ChatRequest(messages=COPY, max_tokens=8), CallContext(turn_type="code_edit"))
    assert r.speculation.rule == "copy-heavy-small-batch"


class Serve:
    def __init__(self, routing: Path, tmp: Path) -> None:
        self.port = free_port()
        self.log = (tmp / f"serve-{self.port}.log").open("wb")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        env.pop("OPENALICE_API_KEY", None)
        cmd = [sys.executable, "-m", "openalice_runner", "serve", "--port", str(self.port),
               "--providers", str(routing), "--policy", str(POLICY)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(f"{self.url}/health", self.proc, timeout=120)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def test_through_serve_plain_streamed_and_tool_calls(pools, tmp_path):
    serve = Serve(pools.routing, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=16)
        assert r.choices[0].message.content
        pieces = list(client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=16, stream=True))
        assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
            tool_choice="required", max_tokens=200, temperature=0, extra_headers={"X-OpenAlice-Turn-Type": "tool_call"},
        )  # fmt: skip
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
        with pytest.raises(openai.BadRequestError) as info:  # vLLM's refusal, as a 400 naming the field
            client.chat.completions.create(
                model="smollm2", messages=CHAT, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "no_such_tool"}},
            )  # fmt: skip
        assert info.value.body["param"] == "tool_choice"
    finally:
        assert serve.stop() == 0


def _sse(url: str, body: dict, headers: dict, out: list, first: threading.Event) -> None:
    """Read one SSE stream into `out` (its data payloads), setting `first` at the first token."""
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as resp:
            out.append(resp.status_code)
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    out.append(line[5:].strip())
                    if '"content"' in line:
                        first.set()
    except httpx.HTTPError as exc:
        out.append(f"transport error: {exc!r}")
    finally:
        first.set()


def test_sigterm_with_streams_in_flight_drains(pools, tmp_path):
    serve = Serve(pools.routing, tmp_path)
    outs: list[list] = [[], []]
    firsts = [threading.Event(), threading.Event()]
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 60, "stream": True}
    threads = [threading.Thread(target=_sse, args=(serve.url, body, {}, outs[i], firsts[i])) for i in range(2)]
    for t in threads:
        t.start()
    for f in firsts:
        assert f.wait(120)
    code = serve.stop()
    for t in threads:
        t.join(120)
    for out in outs:
        assert out[0] == 200 and out[-1] == "[DONE]", out[-3:]
        assert any('"finish_reason"' in x and '"finish_reason":null' not in x.replace(" ", "") for x in out[1:-1])
    assert code == 0


def test_replica_killed_before_the_first_token_falls_over_and_mid_stream_gets_an_error_event(pools, tmp_path):
    """A one-sequence server holds one stream (mid-stream) while a second request waits in its queue
    (no token yet); killed, the first client gets an SSE error event, the second is served by the next
    provider, and the runner goes on serving."""
    model = pools.model
    port = free_port()
    launch = {"model_path": str(model), "max_num_seqs": 1, "max_model_len": 2048, "dtype": "bfloat16",
              "tool_call_parser": "hermes", "chat_template": str(vllm_servers.TEMPLATE), "extra_args": ["--enforce-eager"]}
    extra = {
        "providers": {"edge": {"type": "vllm", "model": "smollm2", "load_cache_s": 0, "load_stale_s": 0, "down_for_s": 30,
                               "pools": {"plain": {"replicas": [f"http://127.0.0.1:{port}"], "launch": launch}}}},
        "routes": [{"name": "default", "chain": ["edge", "cpu"]}],
    }  # fmt: skip
    routing = tmp_path / "providers-edge.yaml"
    routing.write_text(routing_text(pools.ports, model, extra))
    args = vllm_pool_launch(find_pool(load_routing_file(routing), "plain", "edge", dialect="vllm"), None).args
    victim = vllm_servers.VLLMServer(args, name="victim", port=port).start(tmp_path).wait_ready()
    serve = Serve(routing, tmp_path)
    try:
        # a reply of several hundred tokens (the runner passes no ignore_eos): a copy of a long text
        text = "".join(f"def g{i}(x):\n    return x + {i}\n\n" for i in range(60))
        copy = [{"role": "user", "content": f"Repeat this code exactly, nothing else:\n\n{text}"}]
        long = {"model": "smollm2", "messages": copy, "max_tokens": 1200, "temperature": 0, "stream": True}
        mid, queued = [], []
        mid_first, queued_first = threading.Event(), threading.Event()
        t1 = threading.Thread(target=_sse, args=(serve.url, long, {}, mid, mid_first))
        t1.start()
        assert mid_first.wait(120)
        short = {"model": "smollm2", "messages": CHAT, "max_tokens": 12, "stream": True}
        t2 = threading.Thread(target=_sse, args=(serve.url, short, {}, queued, queued_first))
        t2.start()
        deadline = 120
        while victim.metric("vllm:num_requests_waiting") < 1:  # the second request queued, no token yet
            deadline -= 0.1
            assert deadline > 0 and not queued_first.is_set()
            threading.Event().wait(0.1)
        assert "[DONE]" not in mid, "the long reply ended before the kill"
        victim.kill()
        t1.join(120)
        t2.join(120)
        errors = [json.loads(x)["error"] for x in mid[1:] if x.startswith("{") and '"error"' in x]
        assert errors and errors[0]["message"], mid[-3:]
        assert queued[0] == 200 and queued[-1] == "[DONE]"
        assert "".join(json.loads(x)["choices"][0]["delta"].get("content") or ""
                       for x in queued[1:-1] if x.startswith("{") and json.loads(x).get("choices"))  # fmt: skip
        r = httpx.post(f"{serve.url}/v1/chat/completions", json={"model": "smollm2", "messages": CHAT, "max_tokens": 8},
                       timeout=120)  # fmt: skip
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]  # still up
    finally:
        victim.stop()
        assert serve.stop() == 0


smg_problem = None if gateway_affinity.smg_binary().exists() else (
    f"no smg at {gateway_affinity.smg_binary()} (scripts/smg-venv.sh builds it; .ci/run logs its build "
    f"to {vllm_servers.CACHE / 'venvs' / 'smg.build.log'})")


@needs_install(smg_problem)
async def test_a_pool_behind_smg_keeps_each_conversation_on_the_worker_holding_its_prefix(pools, tmp_path):
    """smg 1.13 in front of the two live servers as one pool's workers (`consistent_hashing` on the
    conversation id the runner sends), the workers under `load_from`: each conversation's second
    call is served from the first's cache, and the conversations spread over both workers. Each
    prompt opens with its conversation's number, so no cache block is shared between two of them
    (round_robin would send half the second calls to a worker that never saw their first)."""
    workers = [pools.servers["ngram"].url, pools.servers["plain"].url]
    before = [s.metric("vllm:request_success_total") for s in pools.servers.values()]
    with gateway_affinity.gateway("consistent_hashing", workers, tmp_path) as url:
        launch = {"model_path": str(pools.model), "tool_call_parser": "hermes", "chat_template": str(vllm_servers.TEMPLATE)}
        routing = tmp_path / "providers-gateway.yaml"
        routing.write_text(yaml.safe_dump({
            "providers": {"gw": {"type": "vllm", "model": "smollm2", "load_cache_s": 0, "load_stale_s": 0,
                                 "pools": {"gw": {"replicas": [url.removesuffix("/v1")], "load_from": workers,
                                                  "launch": launch}}}},
            "routes": [{"name": "default", "chain": ["gw"]}]}))  # fmt: skip
        policy = tmp_path / "policy-gateway.yaml"
        policy.write_text('version: 1\ndefault: {method: "off", pool: gw}\n')
        async with Runner.from_config(routing, policy, telemetry=False) as runner:
            for i in range(12):
                ctx = CallContext(turn_type="chat", conversation_id=f"conv-{i}")
                req = ChatRequest(messages=[{"role": "user", "content": f"Conversation {i}. Summarise in a line:\n\n{CODE}"}],
                                  max_tokens=1, temperature=0)  # fmt: skip
                first = await runner.chat(req, ctx)
                second = await runner.chat(req, ctx)
                assert first.usage.prompt_tokens > 256
                assert second.usage.prompt_tokens_details.cached_tokens >= 128, (i, second.usage)
            async with runner.stream(ChatRequest(messages=CHAT, max_tokens=8), CallContext(conversation_id="s")) as chunks:
                streamed = [c async for c in chunks]
    assert "".join(c.delta_text or "" for c in streamed) and streamed[-1].finish_reason
    served = [s.metric("vllm:request_success_total") - b for s, b in zip(pools.servers.values(), before, strict=True)]
    assert sum(served) == 25 and min(served) >= 2, served  # both workers served conversations (1 in 2,048 fails)

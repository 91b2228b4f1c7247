"""The Runner: routing by turn type and model, policy per request, steps, tracing, sync facade."""

from __future__ import annotations

import pytest
from locations import REPO
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stand_ins.engines import tiny_engine
from stand_ins.scripted import scripted_runner
from stand_ins.sglang_server import SGLangStandIn

from openalice_runner import Runner
from openalice_runner.policies import PolicyStore
from openalice_runner.providers.config import UnknownModelError, load_routing_text
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.types import ChatRequest

HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def sglang_pools():
    servers = {
        name: SGLangStandIn(method=m).start()
        for name, m in (("eagle3", "eagle"), ("ngram", "ngram"), ("plain", "off"))
    }
    yield servers
    for s in servers.values():
        s.stop()


def gpu_routing(servers):
    return load_routing_text(
        f"""
providers:
  gpu:
    type: sglang
    model: stand-in/llama-8b
    default_pool: plain
    load_cache_s: 0
    load_stale_s: 0
    load_timeout_s: 30  # the stand-ins answer at once, but a loaded CI host can stall them past 0.5 s
    pools:
      eagle3: {{replicas: [{servers["eagle3"].url}], launch: {{algorithm: EAGLE3, draft_model_path: h, num_steps: 3}}}}
      ngram: {{replicas: [{servers["ngram"].url}], launch: {{algorithm: NGRAM, num_draft_tokens: 8}}}}
      plain: {{replicas: [{servers["plain"].url}]}}
  local: {{type: local, tiny_random: true}}
routes:
  - name: gpu-turns
    match: {{turn_types: [chat, tool_call, reasoning]}}
    chain: [gpu, local]
  - name: small-model
    match: {{models: [tiny]}}
    chain: [local]
  - name: default
    chain: [local]
""",
        "test-routing.yaml",
    )


def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_default_runner_is_the_embedded_engine():
    runner = Runner.from_config(engine=tiny_engine(), telemetry=False)
    async with runner.turn(conversation_id="c", turn_type="chat") as turn:
        r = await turn.chat(HI, max_tokens=3)
    assert r.provider == "local" and r.model == "tiny-random" and r.usage.completion_tokens == 3
    assert r.speculation.policy_version == runner.policy.version  # the repo's default policy decided
    assert runner.model_names() == ["tiny-random"]
    await runner.aclose()


async def test_routing_by_turn_type_and_model_and_pool_by_policy(sglang_pools):
    policy = PolicyStore.from_file(REPO / "policies/gpu-sglang.yaml")
    runner = Runner.from_config(
        gpu_routing(sglang_pools), policy=policy, engine=tiny_engine(), telemetry=False
    )
    async with runner.turn(conversation_id="c", turn_type="tool_call") as turn:
        tool_step = await turn.chat(HI)  # copy-heavy -> ngram pool
        chat_step = await turn.chat(HI, turn_type="chat")  # per-call override -> eagle3 pool
        summarize = await turn.chat(HI, turn_type="summarize", max_tokens=2)  # no gpu route -> local
        small = await turn.chat(
            HI, turn_type="reasoning", model="tiny", max_tokens=2
        )  # gpu-turns takes reasoning, but not the name "tiny" (its chain does not serve it)
    assert (tool_step.provider, tool_step.speculation.pool, tool_step.speculation.rule) == (
        "gpu",
        "ngram",
        "copy-heavy",
    )
    assert (chat_step.speculation.pool, chat_step.speculation.method) == ("eagle3", "eagle")
    assert chat_step.speculation.rule == "chat-small-batch" and chat_step.speculation.target_passes
    assert summarize.provider == "local"
    # A route without `models` takes only the names its chain serves: "tiny" goes to small-model.
    assert small.provider == "local"
    assert [len(s.requests) for s in sglang_pools.values()] == [1, 1, 0]
    r = await runner.chat(
        ChatRequest(messages=HI, model="tiny", max_tokens=2)
    )  # sidecar path, turn type "chat": the name picks small-model
    assert r.provider == "local"
    r = await runner.chat(ChatRequest(messages=HI, model="stand-in/llama-8b", max_tokens=2))
    assert r.provider == "gpu"  # the name gpu serves: gpu-turns takes it
    with pytest.raises(UnknownModelError, match="'nope' is not served"):
        await runner.chat(ChatRequest(messages=HI, model="nope", max_tokens=2))  # no route, no "*"
    await runner.aclose()


async def test_batch_size_comes_from_the_provider_load(sglang_pools):
    for s in sglang_pools.values():
        s.running = 40  # every replica busy: a request joins a batch of 41
    policy = PolicyStore.from_file(REPO / "policies/gpu-sglang.yaml")
    runner = Runner.from_config(
        gpu_routing(sglang_pools), policy=policy, engine=tiny_engine(), telemetry=False
    )
    async with runner.turn(turn_type="chat") as turn:
        r = await turn.chat(HI)
    assert r.speculation.rule == "eagle3-large-batch" and r.speculation.pool == "eagle3"
    await runner.aclose()


async def test_batch_size_is_what_sglang_counts_running_requests_capped(sglang_pools):
    """SGLang runs at most --max-running-requests at once (reported by /v1/loads); a request that
    arrives when the servers are full waits, so the batch it is decoded in is no larger."""
    for s in sglang_pools.values():
        s.running, s.waiting, s.max_running_requests = 40, 9, 32
    policy = PolicyStore.from_file(REPO / "policies/gpu-sglang.yaml")
    runner = Runner.from_config(
        gpu_routing(sglang_pools), policy=policy, engine=tiny_engine(), telemetry=False
    )
    async with runner.turn(turn_type="chat") as turn:
        r = await turn.chat(HI)
    assert r.speculation.rule == "chat-mid-batch" and r.speculation.pool == "eagle3"  # batch 32
    await runner.aclose()


async def test_fallback_to_local_when_the_gpu_pool_is_down(sglang_pools):
    for s in sglang_pools.values():
        s.stop()
    runner = Runner.from_config(
        gpu_routing(sglang_pools), policy=False, engine=tiny_engine(), telemetry=False
    )
    async with runner.turn(turn_type="chat") as turn:
        r = await turn.chat(HI, max_tokens=2)
        chunks = [c async for c in turn.stream(HI, max_tokens=2)]
    assert r.provider == "local" and r.fallback_from == ["gpu"]
    assert chunks[-1].provider == "local" and chunks[-1].fallback_from == ["gpu"]
    await runner.aclose()


class RecordingPolicy:
    """Delegates to a real PolicyStore and records what the runner asks and reports."""

    def __init__(self, store):
        self.store = store
        self.contexts, self.observed = [], []

    def decide(self, ctx):
        self.contexts.append(ctx)
        return self.store.decide(ctx)

    def observe(self, turn_type, method, provider, stats):
        self.observed.append((turn_type, method, provider, stats.completion_tokens))
        self.store.observe(turn_type, method, provider, stats)


async def test_policy_decides_each_call_and_observes_its_stats():
    policy = RecordingPolicy(PolicyStore.from_file(REPO / "policies/default.yaml"))
    runner = Runner.from_config(policy=policy, engine=tiny_engine(), telemetry=False)
    async with runner.turn(conversation_id="c", turn_type="tool_call") as turn:
        r = await turn.chat(HI, max_tokens=3)
        chunks = [c async for c in turn.stream(HI, max_tokens=2, turn_type="chat")]
    asked = [(c.turn_type, c.batch_size, c.provider) for c in policy.contexts]
    # one decision per call, each followed by the batching engine's per-step re-decisions of
    # that call (same turn type, the live batch size: 1 here)
    second = asked.index(("chat", 1, "local"))
    assert asked[0] == ("tool_call", 1, "local")
    assert set(asked[:second]) == {("tool_call", 1, "local")}
    assert set(asked[second:]) == {("chat", 1, "local")}
    assert r.speculation.rule == "copy-heavy-small-batch" and r.speculation.method == "ngram"
    assert policy.observed == [
        ("tool_call", "ngram", "local", 3),
        ("chat", chunks[-1].speculation.method, "local", 2),
    ]
    await runner.aclose()


async def test_steps_and_spans():
    tracer_provider, exporter = traced()
    runner = scripted_runner(telemetry=RunnerTelemetry(tracer_provider))
    async with runner.turn(conversation_id="c9", turn_type="tool_call", agent="alice") as turn:
        await turn.chat(HI, max_tokens=2)
        async with turn.tool("get_weather", call_id="call_1") as step:
            step.result = "sunny"
        _ = [c async for c in turn.stream(HI, max_tokens=2, turn_type="chat")]
        assert turn.step == 3
    spans = {s.name: s for s in exporter.get_finished_spans()}
    turn_span = spans["invoke_agent alice"]
    assert turn_span.attributes["openalice.turn.steps"] == 3
    chats = [s for s in exporter.get_finished_spans() if s.name.startswith("chat")]
    assert [c.attributes["openalice.step"] for c in chats] == [1, 3]
    assert [c.attributes["openalice.turn.type"] for c in chats] == ["tool_call", "chat"]
    tool = spans["execute_tool get_weather"]
    assert tool.attributes["openalice.step"] == 2 and tool.attributes["gen_ai.tool.call.id"] == "call_1"
    assert all(s.parent.span_id == turn_span.context.span_id for s in [*chats, tool])
    await runner.aclose()


async def test_tool_errors_propagate_and_are_recorded():
    tracer_provider, exporter = traced()
    runner = scripted_runner(telemetry=RunnerTelemetry(tracer_provider))
    with pytest.raises(RuntimeError, match="tool blew up"):
        async with runner.turn(turn_type="tool_call") as turn, turn.tool("boom"):
            raise RuntimeError("tool blew up")
    tool = next(s for s in exporter.get_finished_spans() if s.name == "execute_tool boom")
    assert not tool.status.is_ok
    await runner.aclose()


def test_sync_facade():
    tracer_provider, exporter = traced()
    with scripted_runner(telemetry=RunnerTelemetry(tracer_provider)).sync() as runner:
        with runner.turn(conversation_id="s1", turn_type="chat", agent="bob") as turn:
            r = turn.chat(HI, max_tokens=2)
            with turn.tool("lookup") as step:
                step.result = 42
            text = "".join(c.delta_text for c in turn.stream(HI, max_tokens=2))
        assert text == r.content and turn.step == 3
    spans = exporter.get_finished_spans()
    turn_span = next(s for s in spans if s.name == "invoke_agent bob")
    assert all(s.parent.span_id == turn_span.context.span_id for s in spans if s is not turn_span)


async def test_bad_messages_raise_naming_the_field():
    from pydantic import ValidationError

    runner = scripted_runner()
    async with runner.turn() as turn:
        with pytest.raises(ValidationError, match="tool_call_id"):
            await turn.chat([{"role": "tool", "content": "x"}])
        with pytest.raises(ValidationError, match="max_tokens"):
            await turn.chat(HI, max_tokens=0)
        with pytest.raises(TypeError):
            await turn.chat("hello")
    await runner.aclose()


def test_load_refuses_a_routing_file_whose_pools_do_not_fit_the_policy(tmp_path):
    from openalice_runner.config_files import ConfigError

    routing = (REPO / "providers/gpu-example.yaml").read_text()
    drifted = tmp_path / "routing.yaml"
    drifted.write_text(routing.replace("tool_call_parser: llama3           # this pool serves", "# this pool serves"))
    policy = str(REPO / "policies/gpu-sglang.yaml")
    with pytest.raises(ConfigError) as info:
        Runner.from_config(str(drifted), policy=policy, telemetry=False)
    assert [str(p).split(": ", 1)[0] for p in info.value.problems] == [f"{policy}:25:11"]
    assert "pool 'ngram' serves tool_call turns but has no tool_call_parser" in str(info.value)
    # the shipped default policy (policy None) is checked too: its eagle3 rules stop at batch 32
    drifted.write_text(routing.replace("max_running_requests: 64", "max_running_requests: 16"))
    with pytest.raises(ConfigError, match="adaptive pool 'eagle3' runs at most max_running_requests 16"):
        Runner.from_config(str(drifted), telemetry=False)


async def test_routing_reload_is_checked_against_the_served_policy(tmp_path, monkeypatch):
    """The providers watcher runs the load-time pool checks on an edit: one that no longer fits the
    policy is rejected with its positions, and the last good routing stays in force."""
    from openalice_runner.server.routing_watch import RoutingWatcher

    monkeypatch.setenv("SGLANG_API_KEY", "k")
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    routing = (REPO / "providers/gpu-example.yaml").read_text()
    path = tmp_path / "routing.yaml"
    path.write_text(routing)
    policy = str(REPO / "policies/gpu-sglang.yaml")
    runner = Runner.from_config(str(path), policy=policy, engine=tiny_engine(), telemetry=False)
    watcher = RoutingWatcher(runner, path)
    before = runner.routing
    path.write_text(routing.replace("max_running_requests: 64", "max_running_requests: 32") + "\n")
    assert watcher.check() is False and runner.routing is before
    assert f"{policy}:41:55: batch_size reaches 64" in (watcher.last_error or "")
    path.write_text(routing + "\n\n")  # fits again: applied
    assert watcher.check() is True and watcher.last_error is None
    await runner.aclose()

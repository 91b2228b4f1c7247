"""The sidecar over real HTTP on loopback: the official openai client, litellm, errors, policy, metrics,
and the trace a turn leaves.

Chat turns run on the embedded engine's tiny random model; `tool_call` turns route to the stand-in
hosted API (a real OpenAI-protocol server on loopback that answers with deterministic tool calls),
because a random model cannot be made to call a tool.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
from locations import REPO
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support.live_server import LiveServer, metric_sample, wait_for

from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.tracing import RunnerTelemetry
from tests.stand_ins.openai_server import OpenAIStandIn

API_KEY = "test-key-123"
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.standin = OpenAIStandIn().start()
        self.policy_path = tmp / "policy.yaml"
        shutil.copy(REPO / "policies" / "default.yaml", self.policy_path)
        providers = tmp / "providers.yaml"
        providers.write_text(
            "providers:\n"
            "  local: {type: local, tiny_random: true, max_tokens_default: 16}\n"
            f"  cloud: {{type: hosted, model: openai/stand-in, api_base: '{self.standin.url}',"
            " api_key_env: STANDIN_API_KEY, max_retries: 0}\n"
            "routes:\n"
            "  - {name: tools, match: {turn_types: [tool_call], models: [\"*\"]}, chain: [cloud]}\n"
            "  - {name: default, chain: [local]}\n"
        )
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        reader = InMemoryMetricReader()
        telemetry = RunnerTelemetry(tracer_provider, MeterProvider(metric_readers=[reader]))
        self.runner = Runner.from_config(
            providers=str(providers), policy=str(self.policy_path), telemetry=telemetry
        )
        app = create_app(
            self.runner,
            telemetry=telemetry,
            settings=ServerSettings(api_key=API_KEY, max_body_bytes=64 * 1024, metrics_public=True),
            metrics=ServerMetrics(otel_reader=reader),
        )
        self.server = LiveServer(app).start()
        self.base = f"{self.server.url}/v1"
        self.client = openai.OpenAI(base_url=self.base, api_key=API_KEY, max_retries=0, timeout=60)

    def post(self, body, *, headers=None, key: str | None = API_KEY, **kw) -> httpx.Response:
        h = {"Authorization": f"Bearer {key}"} if key else {}
        h.update(headers or {})
        if isinstance(body, dict):
            return httpx.post(f"{self.base}/chat/completions", json=body, headers=h, timeout=60, **kw)
        return httpx.post(f"{self.base}/chat/completions", content=body, headers=h, timeout=60, **kw)

    def close(self) -> None:
        self.server.stop()
        self.standin.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("STANDIN_API_KEY", "sk-stand-in")
    s = Stack(tmp_path_factory.mktemp("server"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _model(stack) -> str:
    return stack.client.models.list().data[0].id


# ---------------------------------------------------------------- the openai client


def test_openai_client_plain_completion(stack):
    r = stack.client.chat.completions.create(
        model=_model(stack),
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        seed=7,
        stop=["\n\n"],
    )
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["speculation"]
    assert spec["method"] in ("off", "ngram", "draft")
    assert spec["policy_version"] == stack.runner.policy.version


def test_follow_up_call_reports_cached_prompt_tokens_over_openai_client(stack):
    """An agent loop's next call resends the history: the sidecar prefills only what is new and
    says so in OpenAI's own usage field."""
    history = [{"role": "user", "content": "Name a colour and a fruit, please."}]
    first = stack.client.chat.completions.create(model=_model(stack), messages=history, max_tokens=6)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Another one?"}]
    second = stack.client.chat.completions.create(model=_model(stack), messages=history, max_tokens=6)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 1 <= cached < second.usage.prompt_tokens


def test_max_completion_tokens_is_honoured(stack):
    r = stack.client.chat.completions.create(
        model=_model(stack), messages=[{"role": "user", "content": "Count"}], max_completion_tokens=3
    )
    assert r.usage.completion_tokens <= 3


def test_openai_client_streaming_with_final_usage_chunk(stack):
    stream = stack.client.chat.completions.create(
        model=_model(stack),
        messages=[{"role": "user", "content": "Tell a story"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert 0 < last.usage.completion_tokens <= 8
    assert "speculation" in last.model_extra
    assert all(c.usage is None for c in body)
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text  # something streamed


def test_stream_without_include_usage_has_no_usage_chunk(stack):
    with httpx.stream(
        "POST",
        f"{stack.base}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in p and p["choices"] for p in payloads)


def test_tools_turn_over_openai_client_leaves_one_agent_span(stack):
    """Model call -> tool -> model call, as a loop in another process runs it, with its traceparent."""
    stack.spans.clear()
    headers = {
        "X-OpenAlice-Conversation-Id": "conv-tools-1",
        "X-OpenAlice-Turn-Type": "tool_call",
        "X-OpenAlice-Agent": "alice",
        "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
    }
    messages = [{"role": "user", "content": "Paris"}]
    first = stack.client.chat.completions.create(
        model="stand-in",
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        extra_headers=headers,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    time.sleep(0.05)  # the loop "runs" its tool
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = stack.client.chat.completions.create(
        model="stand-in", messages=messages, tools=[WEATHER_TOOL], extra_headers=headers
    )
    assert second.choices[0].finish_reason == "stop"
    assert "sunny" in second.choices[0].message.content

    spans = list(stack.spans.get_finished_spans())
    [agent] = [s for s in spans if s.name == "invoke_agent alice"]
    chats = sorted((s for s in spans if s.name.startswith("chat ")), key=lambda s: s.start_time)
    [tool] = [s for s in spans if s.name == "execute_tool get_weather"]
    assert len(chats) == 2
    # The caller's trace continues: our turn span is the child of the caller's span.
    assert format(agent.context.trace_id, "032x") == CALLER_TRACE
    assert format(agent.parent.span_id, "016x") == CALLER_SPAN
    for child in (*chats, tool):
        assert child.parent.span_id == agent.context.span_id
        assert child.context.trace_id == agent.context.trace_id
    a = agent.attributes
    assert a["gen_ai.operation.name"] == "invoke_agent"
    assert a["gen_ai.conversation.id"] == "conv-tools-1"
    assert a["openalice.turn.type"] == "tool_call"
    assert a["openalice.turn.steps"] == 3
    assert a["openalice.turn.end_reason"] == "final_answer"
    for chat in chats:
        c = chat.attributes
        assert chat.kind is SpanKind.CLIENT
        assert c["gen_ai.operation.name"] == "chat"
        assert c["gen_ai.provider.name"] == "openai"
        assert c["gen_ai.request.model"] == "stand-in"
        assert c["gen_ai.conversation.id"] == "conv-tools-1"
        assert c["openalice.provider"] == "cloud"
        assert c["gen_ai.usage.input_tokens"] > 0
    assert chats[0].attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert chats[1].attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert [c.attributes["openalice.step"] for c in chats] == [1, 3]
    t = tool.attributes
    assert t["gen_ai.tool.name"] == "get_weather"
    assert t["gen_ai.tool.call.id"] == call.id
    assert t["openalice.step"] == 2
    # The tool span covers the gap between the first response and the second request.
    assert chats[0].end_time <= tool.start_time + 5_000_000
    assert tool.end_time <= chats[1].start_time
    assert (tool.end_time - tool.start_time) >= 40_000_000


def test_tools_turn_streamed_over_openai_client(stack):
    stack.spans.clear()
    headers = {"X-OpenAlice-Conversation-Id": "conv-tools-2", "X-OpenAlice-Turn-Type": "tool_call"}
    stream = stack.client.chat.completions.create(
        model="stand-in",
        messages=[{"role": "user", "content": "Rome"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
        extra_headers=headers,
    )
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    call_id = next(d.id for d in deltas if d.id)
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == '{"city": "Rome"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    final = stack.client.chat.completions.create(
        model="stand-in",
        messages=[
            {"role": "user", "content": "Rome"},
            {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "cloudy"},
        ],
        extra_headers=headers,
    )  # fmt: skip
    assert "cloudy" in final.choices[0].message.content
    spans = list(stack.spans.get_finished_spans())
    [agent] = [s for s in spans if s.name.startswith("invoke_agent")]
    names = sorted(
        s.name for s in spans if s.parent is not None and s.parent.span_id == agent.context.span_id
    )
    assert names == ["chat stand-in", "chat stand-in", "execute_tool get_weather"]


def test_embedded_models_tool_call_streams_in_pieces_to_the_openai_client(stack):
    """The embedded engine's grammar-constrained call streams as OpenAI's do (first delta with id,
    type and name, then argument pieces without them): the openai SDK's stream helper joins it into
    the call the unstreamed reply has."""
    zone_tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
        "additionalProperties": False}}}  # fmt: skip
    body = {"model": _model(stack), "messages": [{"role": "user", "content": "time?"}], "tools": [zone_tool],
            "tool_choice": "required", "max_tokens": 40, "temperature": 0}  # fmt: skip
    with stack.client.chat.completions.stream(**body) as stream:
        pieces = [e.arguments_delta for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    whole = stack.client.chat.completions.create(**body)
    [streamed], [call] = final.choices[0].message.tool_calls, whole.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert len(pieces) >= 2 and "".join(pieces) == call.function.arguments
    assert final.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"


def test_request_without_conversation_is_its_own_turn(stack):
    stack.spans.clear()
    stack.client.chat.completions.create(
        model=_model(stack), messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    spans = list(stack.spans.get_finished_spans())
    [agent] = [s for s in spans if s.name.startswith("invoke_agent")]
    [chat] = [s for s in spans if s.name.startswith("chat ")]
    assert chat.parent.span_id == agent.context.span_id
    assert agent.parent is None
    assert chat.attributes["openalice.turn.type"] == "chat"
    assert chat.attributes["gen_ai.provider.name"] == "openalice"


def test_turn_context_from_metadata(stack):
    stack.spans.clear()
    r = stack.post(
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "metadata": {"conversation_id": "meta-1", "turn_type": "summarize", "step": "4"},
        }
    )
    assert r.status_code == 200, r.text
    [chat] = [s for s in stack.spans.get_finished_spans() if s.name.startswith("chat ")]
    assert chat.attributes["openalice.turn.type"] == "summarize"
    assert chat.attributes["gen_ai.conversation.id"] == "meta-1"
    assert chat.attributes["openalice.step"] == 4


# ---------------------------------------------------------------- litellm


def test_litellm_through_openai_prefix_and_api_base(stack):
    import litellm

    model = f"openai/{_model(stack)}"
    r = litellm.completion(
        model=model,
        api_base=stack.base,
        api_key=API_KEY,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
    )
    assert r.choices[0].message.content is not None
    assert 0 < r.usage.completion_tokens <= 4
    chunks = list(
        litellm.completion(
            model=model,
            api_base=stack.base,
            api_key=API_KEY,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
    )
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_litellm_tools(stack):
    import litellm

    r = litellm.completion(
        model="openai/stand-in",
        api_base=stack.base,
        api_key=API_KEY,
        messages=[{"role": "user", "content": "Oslo"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        extra_headers={"X-OpenAlice-Turn-Type": "tool_call"},
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"


# ---------------------------------------------------------------- errors: OpenAI's shape, naming the field


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_api_key_required(stack):
    err = _error(stack.post({"messages": [{"role": "user", "content": "x"}]}, key=None), 401)
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    _error(stack.post({"messages": [{"role": "user", "content": "x"}]}, key="wrong"), 401)
    bad = openai.OpenAI(base_url=stack.base, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Liveness stays open; scraping too, with metrics_public (`serve --metrics-public`).
    assert httpx.get(f"{stack.server.url}/health").status_code == 200
    assert httpx.get(f"{stack.server.url}/metrics").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x"}], "bogus": 1}, "bogus"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": 5}}}]}, "tools[0].function.parameters"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "regex"}}, "response_format.type"),
    ],
)
def test_bad_bodies_get_400_naming_the_field(stack, body, param):
    err = _error(stack.post(body), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
        assert param.split("[")[0] in err["message"]


def test_malformed_json_and_non_object_body(stack):
    err = _error(stack.post(b'{"messages": [', headers={"Content-Type": "application/json"}), 400)
    assert err["code"] == "invalid_json"
    _error(stack.post(b"[1, 2]", headers={"Content-Type": "application/json"}), 400)
    _error(stack.post(b"\xff\xfe", headers={"Content-Type": "application/json"}), 400)


def test_bad_turn_headers(stack):
    err = _error(
        stack.post({"messages": [{"role": "user", "content": "x"}]}, headers={"X-OpenAlice-Step": "two"}), 400
    )
    assert err["param"] == "step"


def test_body_size_limit(stack):
    huge = {"messages": [{"role": "user", "content": "x" * (70 * 1024)}]}
    err = _error(stack.post(huge), 413)
    assert err["code"] == "body_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}]}'

    err = _error(stack.post(chunked(), headers={"Content-Type": "application/json"}), 413)
    assert err["code"] == "body_too_large"


def test_unknown_route_and_method(stack):
    _error(httpx.get(f"{stack.base}/nope", headers={"Authorization": f"Bearer {API_KEY}"}), 404)
    _error(httpx.get(f"{stack.base}/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}), 405)


# ---------------------------------------------------------------- models, health, policy, metrics


def test_models_and_health(stack):
    models = stack.client.models.list().data
    assert models and all(m.object == "model" for m in models)
    health = httpx.get(f"{stack.server.url}/health").json()
    assert health["status"] == "ok"
    assert health["policy_version"] == stack.runner.policy.version


def test_policy_endpoint_and_hot_reload(stack):
    h = {"Authorization": f"Bearer {API_KEY}"}
    before = httpx.get(f"{stack.base}/policy", headers=h).json()
    assert before["version"] == stack.runner.policy.version
    assert before["policy"]["name"] == "default"
    text = stack.policy_path.read_text()

    stack.policy_path.write_text(text.replace("name: default", "name: edited"))
    edited = wait_for(
        lambda: httpx.get(f"{stack.base}/policy", headers=h).json(),
        lambda v: v["version"] != before["version"],
    )
    assert edited["policy"]["name"] == "edited"
    assert "last_error" not in edited

    stack.policy_path.write_text(text.replace("name: default", "name: [broken"))
    broken = wait_for(
        lambda: httpx.get(f"{stack.base}/policy", headers=h).json(), lambda v: "last_error" in v
    )
    assert broken["version"] == edited["version"]  # the last good policy stays in force
    assert broken["policy"]["name"] == "edited"

    stack.policy_path.write_text(text)
    restored = wait_for(
        lambda: httpx.get(f"{stack.base}/policy", headers=h).json(),
        lambda v: v["version"] == before["version"],
    )
    assert "last_error" not in restored


def test_health_shows_a_broken_policy_edit_without_paths_or_texts_unless_authenticated(stack):
    health_url = f"{stack.server.url}/health"
    h = {"Authorization": f"Bearer {API_KEY}"}
    text = stack.policy_path.read_text()
    assert "last_error" not in httpx.get(health_url).json()["policy"]
    try:
        stack.policy_path.write_text(text + "\nrules: [oops\n")
        public = wait_for(lambda: httpx.get(health_url).json()["policy"], lambda v: "last_error" in v)
        assert public["source"] == "policy.yaml"
        assert public["last_error"].startswith("policy.yaml:")  # where, FILE:LINE:COL
        assert str(stack.policy_path.parent) not in json.dumps(httpx.get(health_url).json())
        full = httpx.get(health_url, headers=h).json()["policy"]
        assert full["source"] == str(stack.policy_path)
        assert full["last_error"] == str(stack.runner.policy.last_error)  # the problems' text, with the key
        assert full["last_error"] not in public["last_error"]
    finally:
        stack.policy_path.write_text(text)
    wait_for(lambda: httpx.get(health_url).json()["policy"], lambda v: "last_error" not in v)


def test_metrics_scrape_counts_the_request(stack):
    before = httpx.get(f"{stack.server.url}/metrics").text
    stack.post(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"X-OpenAlice-Turn-Type": "rag"},
    )
    after = httpx.get(f"{stack.server.url}/metrics").text
    name = "openalice_chat_completions_total"
    assert (
        metric_sample(after, name, turn_type="rag", outcome="ok")
        == metric_sample(before, name, turn_type="rag", outcome="ok") + 1
    )
    route = {"route": "/v1/chat/completions", "status": "200"}
    assert (
        metric_sample(after, "openalice_http_requests_total", **route)
        >= metric_sample(before, "openalice_http_requests_total", **route) + 1
    )
    # The GenAI histograms recorded by RunnerTelemetry, rendered for Prometheus.
    assert metric_sample(after, "gen_ai_client_operation_duration_seconds_count", openalice_turn_type="rag") >= 1
    assert metric_sample(after, "gen_ai_client_token_usage_count", gen_ai_token_type="output") >= 1


def test_client_leaving_mid_stream_frees_its_slot_and_ends_its_turn(stack):
    url = stack.server.url
    labels = {"turn_type": "reasoning", "stream": "true"}
    with httpx.stream(
        "POST",
        f"{stack.base}/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Write at length"}],
            "max_tokens": 256,
            "stream": True,
        },
        headers={"Authorization": f"Bearer {API_KEY}", "X-OpenAlice-Turn-Type": "reasoning"},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event

    def settled():
        text = httpx.get(f"{url}/metrics").text
        done = sum(
            metric_sample(text, "openalice_chat_completions_total", outcome=o, **labels)
            for o in ("ok", "cancelled")
        )
        return text, done

    text, done = wait_for(settled, lambda v: v[1] == 1)
    assert metric_sample(text, "openalice_requests_in_flight") == 0
    assert metric_sample(text, "openalice_chat_completions_total", outcome="error", **labels) == 0
    spans = [
        s for s in stack.spans.get_finished_spans() if s.attributes.get("openalice.turn.type") == "reasoning"
    ]
    assert {s.name.split()[0] for s in spans} == {"invoke_agent", "chat"}  # both ended, none left open

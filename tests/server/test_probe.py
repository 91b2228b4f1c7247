"""Issue 46's probe of `serve`, the server's findings: a client-chosen `model` that grew /metrics and
memory (10), a huge body rendered before the context check (11), keys and request text in the trace
file and a trace file without a cap (15), deep history arguments answered 500 (16a) and a stream
whose deadline did not hold while a send blocked (16c). Real HTTP on loopback; the embedded engine's
tiny random model, or a scripted provider where the test needs a stream that never ends."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import stat
import threading

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stand_ins.engines import tiny_engine
from stand_ins.scripted import ScriptedProvider, scripted_runner
from support.live_server import LiveServer, wait_for

from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.connections import guarded_h11
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.tracing.jsonl import JsonLinesSpanExporter
from openalice_runner.types import ChatChunk, new_id

HI = [{"role": "user", "content": "hi"}]
KEY = "probe-key-46-9d1e"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 4}
routes:
  - {name: default, match: {models: ["*"]}, chain: [local]}
"""


class Stack:
    """The app over the tiny engine (or the runner `make_runner` builds with the telemetry), its spans
    (FastAPI's server span included) kept in memory; `guarded`: under serve's own HTTP protocol."""

    def __init__(self, make_runner=None, *, record_content: bool = False, guarded: bool = False) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        reader = InMemoryMetricReader()
        telemetry = RunnerTelemetry(
            self.tracer_provider, MeterProvider(metric_readers=[reader]), record_content=record_content
        )
        if make_runner is None:
            self.runner = Runner.from_config(
                providers=load_routing_text(PROVIDERS), policy=False, telemetry=telemetry, engine=tiny_engine()
            )
        else:
            self.runner = make_runner(telemetry)
        self.metrics = ServerMetrics(otel_reader=reader)
        app = create_app(
            self.runner, telemetry=telemetry, settings=ServerSettings(api_key=KEY), metrics=self.metrics,
            tracer_provider=self.tracer_provider,
        )  # fmt: skip
        self.server = LiveServer(app)
        if guarded:
            self.server.server.config.http = guarded_h11(10.0, None)
        self.server.start()
        self.url = self.server.url

    def post(self, body, headers=None, timeout=60) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json=body, headers={**AUTH, **(headers or {})},
                          timeout=timeout)  # fmt: skip

    def span_text(self) -> str:
        return json.dumps([{"name": s.name, "attributes": dict(s.attributes or {})}
                           for s in self.spans.get_finished_spans()], default=str)  # fmt: skip


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.server.stop()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    return r.json()["error"]


# ---- 15: no key, query string or stop string in spans without --record-content; a capped trace file


def test_server_span_keeps_no_query_string_and_no_raw_path(stack):
    stack.spans.clear()
    assert httpx.get(f"{stack.url}/v1/models?api_key={KEY}", timeout=30).status_code == 401
    assert httpx.get(f"{stack.url}/v1/models/{KEY}", timeout=30).status_code == 401
    assert httpx.get(f"{stack.url}/v1/models/{KEY}x", headers=AUTH, timeout=30).status_code == 404
    assert httpx.get(f"{stack.url}/elsewhere/{KEY}", headers=AUTH, timeout=30).status_code == 404
    servers = [s for s in stack.spans.get_finished_spans() if s.kind.name == "SERVER"]
    assert len(servers) == 4  # the server spans are there, redacted
    assert KEY not in stack.span_text()
    paths = [s.attributes.get("url.path") for s in servers]
    assert paths == ["/v1/models", "/v1/models/{id}", "/v1/models/{id}", "other"]
    assert not any("url.query" in s.attributes for s in servers)


def test_stop_strings_reach_spans_only_with_record_content(stack):
    stop = "STOP-MARKER-46"
    stack.spans.clear()
    assert stack.post({"messages": HI, "max_tokens": 2, "stop": [stop]}).status_code == 200
    assert "gen_ai.operation.name" in stack.span_text()  # the chat span is there
    assert stop not in stack.span_text()
    recording = Stack(record_content=True)
    try:
        assert recording.post({"messages": HI, "max_tokens": 2, "stop": [stop]}).status_code == 200
        assert stop in recording.span_text()
    finally:
        recording.server.stop()


def test_trace_file_is_capped_and_rotated_once_owner_only(tmp_path):
    path = tmp_path / "trace.jsonl"
    exporter = JsonLinesSpanExporter(path, max_bytes=4096)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for i in range(200):  # ~200 bytes a span: several rotations
        tracer.start_span(f"span-{i}", attributes={"i": i}).end()
    exporter.force_flush()
    rotated = tmp_path / "trace.jsonl.1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl", "trace.jsonl.1"]
    for p in (path, rotated):
        assert p.stat().st_size <= 4096
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    names = [json.loads(line)["name"] for p in (rotated, path) for line in p.read_text().splitlines()]
    assert names[-1] == "span-199" and names == [f"span-{i}" for i in range(200 - len(names), 200)]
    big = "x" * 5000  # a span larger than the cap on its own is left out and counted
    tracer.start_span("huge", attributes={"big": big}).end()
    assert exporter.oversized == 1 and path.stat().st_size <= 4096
    exporter.shutdown()


# ---- 14: watched files that are not regular files: refused at once, the last good config kept

POLICY = "rules:\n  - name: tools\n    match: {turn_type: tool_call}\n    method: ngram\n    gamma: 5\ndefault: {method: off}\n"
ROUTING = PROVIDERS.replace("name: default", "name: edited")


class _RoutingRunner:
    """What RoutingWatcher needs of a runner: it records what it is given to apply."""

    policy = None

    def __init__(self) -> None:
        self.applied: list = []

    def apply_routing(self, routing) -> list[str]:
        self.applied.append(routing)
        return []


def _in_thread(work, timeout: float = 20.0):
    """`work()`'s result; the test fails (instead of hanging) when it does not return in time."""
    out: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            out["value"] = work()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout), "blocked: a read that should have been refused at once"
    return out.get("value")


def _swap(path, make) -> None:
    path.unlink()
    make(path)


@pytest.mark.parametrize(
    ("make", "kind"),
    [(os.mkfifo, "a FIFO"), (lambda p: p.symlink_to("/dev/zero"), "a character device")],
    ids=["fifo", "dev-zero"],
)
def test_a_watched_file_swapped_for_a_fifo_or_a_device_is_refused_at_once(tmp_path, make, kind):
    from openalice_runner.policies import PolicyStore, RequestContext
    from openalice_runner.server.routing_watch import RoutingWatcher

    providers, policy = tmp_path / "providers.yaml", tmp_path / "policy.yaml"
    providers.write_text(PROVIDERS)
    policy.write_text(POLICY)
    runner = _RoutingRunner()
    watcher = RoutingWatcher(runner, providers)
    store = PolicyStore.from_file(policy)
    _swap(providers, make)
    _swap(policy, make)
    assert _in_thread(watcher.check) is False
    assert f"not a regular file ({kind})" in watcher.last_error and watcher.last_error.startswith(f"{providers}:1:1:")
    assert _in_thread(store.reload_if_changed) is False
    assert f"not a regular file ({kind})" in str(store.last_error)
    assert store.decide(RequestContext("tool_call", 1, "local")).gamma == 5  # the last good policy
    providers.unlink()
    providers.write_text(ROUTING)  # a valid edit still applies
    assert watcher.check() is True and watcher.last_error is None and len(runner.applied) == 1


def test_a_watched_file_past_the_limit_is_not_read_whole(tmp_path):
    from openalice_runner.config_files.reading import read_operator_file
    from openalice_runner.config_files.yaml_nodes import LIMITS

    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (LIMITS.max_bytes + 1))
    with pytest.raises(OSError, match="larger than the limit"):
        read_operator_file(big)
    big.write_bytes(b"#" * LIMITS.max_bytes)
    assert len(read_operator_file(big)) == LIMITS.max_bytes


# ---- 16a: history arguments nested too deep are a 400 naming the field


def test_deeply_nested_history_arguments_are_a_400_naming_the_field(stack):
    def body(arguments: str) -> dict:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}  # fmt: skip

    error = _error(stack.post(body("[" * 5000)), 400)
    assert error["param"] == "messages[1].tool_calls[0].function.arguments" and "nested" in error["message"]
    assert stack.post(body("[" * 100 + "]" * 100)).status_code == 200  # deep, but within the bound
    assert stack.post(body('"' + "[" * 1000 + '"')).status_code == 200  # brackets inside a string


# ---- 16c: the stream's deadline holds while a send blocks on a client that does not read


class EndlessProvider(ScriptedProvider):
    """Streams 64 KiB chunks until it is closed (`closed` is set then), or LIMIT of them: a stream
    whose sends never blocked would run out there, and is told apart by `sent`."""

    LIMIT = 1000  # 64 MB: far past what the socket buffers of a client that does not read take

    def __init__(self) -> None:
        super().__init__()
        self.closed = threading.Event()
        self.sent = 0

    async def _chunks(self, request, ctx):
        try:
            chunk_id, piece = new_id("chatcmpl"), "x" * 65536
            for i in range(self.LIMIT):
                self.sent = i + 1
                yield ChatChunk.text(chunk_id, self.model, piece, role=i == 0)
                await asyncio.sleep(0)
        finally:
            self.closed.set()


def test_stream_deadline_holds_while_a_send_blocks_on_a_client_that_does_not_read():
    provider = EndlessProvider()
    stack = Stack(lambda telemetry: scripted_runner(provider, telemetry=telemetry), guarded=True)
    client = socket.socket()
    try:
        body = json.dumps({"messages": HI, "stream": True}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nX-OpenAlice-Timeout: 2\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once; never read below
        client.connect(("127.0.0.1", stack.server.port))
        client.sendall(head + body)
        # Past the 2 s deadline the provider's stream is closed, though every send is still blocked.
        assert provider.closed.wait(30), "the stream outlived its deadline behind a blocked send"
        assert provider.sent < EndlessProvider.LIMIT  # cut, not run out: the sends did block
        # The provider's stream is closed before the outcome is counted (server/streaming.py, close):
        # wait for the count, of whatever outcome, then read which one it was.
        completions = stack.metrics.chat_completions
        outcomes = wait_for(
            lambda: {o: completions.labels(turn_type="chat", stream="true", outcome=o)._value.get()
                     for o in ("ok", "deadline", "cancelled", "error")},
            lambda counts: sum(counts.values()) >= 1, timeout=30)  # fmt: skip
        assert outcomes["deadline"] == 1 and sum(outcomes.values()) == 1, outcomes
        assert stack.metrics.cancelled.labels(reason="deadline")._value.get() == 1
        client.settimeout(30)  # and the connection is cut: reading what was buffered ends, it does not wait
        try:
            while client.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
    finally:
        client.close()  # (where the test failed: the server sees the client go, and stops the stream)
        stack.server.stop()

# ---- 10: a client's `model` grows neither /metrics nor memory


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_a_7mb_model_name_is_a_400_and_metrics_and_memory_stay_small(stack):
    assert stack.post({"messages": HI, "max_tokens": 1, "model": "fine-name"}).status_code == 200
    before = httpx.get(f"{stack.url}/metrics", headers=AUTH, timeout=60).text
    gc.collect()
    rss_before = _rss_mib()
    for i in range(3):
        error = _error(stack.post({"messages": HI, "max_tokens": 1, "model": f"{i}" + "m" * 7_000_000}), 400)
        assert error["param"] == "model" and "256" in error["message"]
    error = _error(stack.post({"messages": HI, "max_tokens": 1, "model": "m" * 257}), 400)
    assert error["param"] == "model"
    assert stack.post({"messages": HI, "max_tokens": 1, "model": "m" * 256}).status_code == 200  # at the bound
    after = httpx.get(f"{stack.url}/metrics", headers=AUTH, timeout=60).text
    assert len(after) < len(before) + 64 * 1024  # no series holds the long name
    assert "m" * 200 not in after  # the 256-character name is a label "other", not itself
    gc.collect()
    assert _rss_mib() - rss_before < 150  # the bodies came and went (a kept 7 MB label cost 430 MB)


def test_long_label_values_are_other():
    from openalice_runner.tracing import attributes as A
    from openalice_runner.tracing.labels import MAX_VALUE_CHARS, LabelBounds

    bounds = LabelBounds()
    assert bounds.bound({A.GEN_AI_REQUEST_MODEL: "x" * (MAX_VALUE_CHARS + 1)})[A.GEN_AI_REQUEST_MODEL] == "other"
    assert bounds.bound({A.GEN_AI_REQUEST_MODEL: "x" * MAX_VALUE_CHARS})[A.GEN_AI_REQUEST_MODEL] == "x" * MAX_VALUE_CHARS
    assert bounds.turn_type("t" * (MAX_VALUE_CHARS + 1)) == "other"


def test_policy_tables_and_adaptive_estimates_keyed_by_client_names_are_bounded():
    from openalice_runner.policies import PolicyStore, RequestContext
    from openalice_runner.policies.adaptive import MAX_KEYS
    from openalice_runner.policies.bounded import MAX_ENTRIES
    from openalice_runner.speculation import SpeculationOutcome

    store = PolicyStore.from_text(
        "rules:\n  - {name: tools, match: {turn_type: tool_call, model: m-named, batch_size: {max: 4}},"
        " method: ngram, gamma: 4}\n"
        "  - {name: chat, match: {batch_size: {max: 4}}, method: ngram, gamma: auto, min_gamma: 1, max_gamma: 6,"
        " prior_alpha: 0.01}\ndefault: {method: off}\n"
    )
    outcome = SpeculationOutcome(method="ngram", gamma=3, proposed=30, accepted=15, target_passes=10,
                                 completion_tokens=25)  # fmt: skip
    for i in range(3 * MAX_ENTRIES):  # a client's made-up models and turn types, each once
        plan = store.decide(RequestContext(f"turn-{i}", None if i % 2 else 2, "local", f"model-{i}"))
        assert plan.rule == ("default" if i % 2 else "chat")
        store.observe(f"turn-{i}", "ngram", "local", outcome)
    compiled = store._compiled
    assert len(compiled._pieces) <= 3  # made-up names match as "no name" does: one entry for them all
    assert len(compiled._tables) <= MAX_ENTRIES
    assert len(store.adaptive._alpha) <= MAX_KEYS and len(store.adaptive._off_counters) <= MAX_KEYS
    assert store.decide(RequestContext("tool_call", 1, "local", "m-named")).rule == "tools"


def test_prompt_log_cuts_a_long_model_name(tmp_path):
    from openalice_runner.prompt_log import MAX_ENTRY_BYTES, PromptLog
    from openalice_runner.types import ChatRequest

    log = PromptLog(tmp_path / "prompts.jsonl")
    request = ChatRequest.model_validate({"messages": HI}).model_copy(update={"model": "m" * 4_000_000})
    log.record(request, "chat")
    data = (tmp_path / "prompts.jsonl").read_bytes()
    assert len(data) <= 1024 < MAX_ENTRY_BYTES and json.loads(data)["model"] == "m" * 256


# ---- 11: a body too large for the context is refused before its prompt is rendered


class RenderSpy:
    """The tiny engine, recording how many messages each chat-template render was given."""

    def __init__(self, real) -> None:
        self.real = real
        self.rendered: list[int] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def render_chat(self, messages, tools=None):
        self.rendered.append(len(messages))
        return self.real.render_chat(messages, tools)

    def chat_text(self, messages, tools=None):  # the prompt builder's path where the engine renders text
        self.rendered.append(len(messages))
        return self.real.chat_text(messages, tools)


def test_many_empty_messages_are_refused_before_rendering():
    spy = RenderSpy(tiny_engine())
    stack = Stack(lambda telemetry: Runner.from_config(
        providers=load_routing_text(PROVIDERS), policy=False, telemetry=telemetry, engine=spy))  # fmt: skip
    try:
        assert stack.post({"messages": HI, "max_tokens": 1}).status_code == 200
        for count in (5_000, 200_000):  # 200,000: 6.6 MB, no characters to count (the probe's 254,000)
            spy.rendered.clear()
            many = [{"role": "user", "content": ""}] * count
            error = _error(stack.post({"messages": many, "max_tokens": 1}, timeout=120), 400)
            assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
            assert f"{count} messages" in error["message"]
            assert spy.rendered == []  # refused by the count, not by a render
        # A request within the context still renders and is served: the count is a lower bound.
        fits = [{"role": "user" if i % 2 == 0 else "assistant", "content": "ok"} for i in range(101)]
        assert stack.post({"messages": fits, "max_tokens": 1}).status_code == 200
        assert spy.rendered and spy.rendered[-1] >= 101
    finally:
        stack.server.stop()


def test_the_message_count_bound_never_exceeds_the_rendered_prompt():
    from openalice_runner.providers.embedded.prompt import ContextBounds
    from openalice_runner.types import ChatRequest

    engine = tiny_engine()
    bounds = ContextBounds("local", lambda: engine.context_length, lambda: engine.tokenizer, lambda: engine)
    overhead = bounds.message_overhead()
    assert set(overhead) == {"system", "user", "assistant"} and min(overhead.values()) >= 1
    for messages in (
        [{"role": "system", "content": ""}, *[{"role": "user", "content": ""}] * 30],
        [{"role": r, "content": c} for r, c in [("user", "a b"), ("assistant", ""), ("user", "\n\n"), ("assistant", "x")]] * 20,
    ):
        request = ChatRequest.model_validate({"messages": messages})
        least = sum(overhead[m.role] for m in request.messages)
        assert least <= len(engine.render_chat(request.message_dicts()))


def test_serve_takes_the_trace_file_cap_and_refuses_a_tiny_one():
    from openalice_runner.cli import build_parser
    from openalice_runner.cli.serve import _check_limits
    from openalice_runner.tracing.jsonl import DEFAULT_MAX_BYTES

    parser = build_parser()
    assert parser.parse_args(["serve"]).trace_file_max_bytes == DEFAULT_MAX_BYTES
    assert _check_limits(parser.parse_args(["serve", "--trace-file-max-bytes", "100"])) == (
        "--trace-file-max-bytes must be at least 4096"
    )

"""Tenants (`serve --keys FILE`, issue 48 Build 3): each key is a tenant, and what one tenant's requests
leave behind never serves another's: the suffix drafter's store, the prefix cache, conversation
histories and turns, adaptive-γ statistics. The keys file's bad inputs are refused at FILE:LINE:COL and
the last good one stays; each key maps to its tenant; a tenant's rate limit answers 429 with Retry-After
in the wire's own shape; vLLM pools get the tenant as `cache_salt`.

Each isolation test has its control: the same sequence within one tenant does reuse (many suffix drafts
accepted, cached tokens > 0), so the test fails if isolation were tested on something that never reuses.
The served engine is a tiny random model with prefix reuse on; the suffix test samples with a seed
(temperature 1: a reply that prompt lookup alone can hardly draft, and the same seed gives the same
tokens whatever the drafts), so the drafts accepted are those from the store."""

from __future__ import annotations

import hashlib
import io
import json
import os

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.live_server import LiveServer

from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from openalice_runner.server.tenants.keys_file import KeysFileError, load_keys_file, load_keys_text
from openalice_runner.tracing import RunnerTelemetry
from openalice_runner.tracing import attributes as A

PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 16}
routes:
  - {name: default, chain: [local]}
"""
SUFFIX = "version: 1\nname: suffix\ndefault:\n  method: suffix\n  gamma: 4\n"
# each test its own tenants, so what one leaves behind in the served engine cannot move another's figures
SERVED = ("a", "b", "c", "d", "limited", "sa", "sb", "sd", "pa", "pb", "fx")
KEYS = {name: f"key-of-{name}-0123456789abcdef" for name in (*SERVED, "e")}


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _keys_yaml(*names: str, extra: str = "") -> str:
    lines = ["tenants:"]
    for name in names:
        lines += [f"  - name: {name}", f"    hash: {_hash(KEYS[name])}"]
        if name == "limited":
            lines += ["    requests_per_minute: 2", "    speculation_info: summary", "    stream_release: fixed:8"]
        if name == "fx":
            lines += ["    stream_release: fixed:4"]
    return "\n".join(lines) + "\n" + extra


def _write(path, text: str) -> None:
    path.write_text(text)
    os.chmod(path, 0o600)


@pytest.fixture(scope="module")
def engine():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from openalice_runner.engine import Engine

    return Engine.tiny_random(seed=0, prefix_reuse=True)  # prefix reuse on: the cross-tenant test needs it


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    policy, keys = tmp / "suffix.yaml", tmp / "keys.yaml"
    policy.write_text(SUFFIX)
    _write(keys, _keys_yaml(*SERVED))
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry = RunnerTelemetry(tracer_provider, MeterProvider())
    runner = Runner.from_config(
        providers=load_routing_text(PROVIDERS), policy=str(policy), telemetry=telemetry, engine=engine
    )
    # the watcher is driven by the tests (check()), not by its clock: a long interval keeps it out of the way
    settings = ServerSettings(keys_file=str(keys), watch_interval_s=3600, metrics_public=True)
    app = create_app(runner, telemetry=telemetry, settings=settings)
    live = LiveServer(app).start()
    live.app, live.runner, live.spans, live.keys_path = app, runner, spans, keys
    live.client = httpx.Client(base_url=live.url, timeout=120)
    yield live
    live.client.close()
    live.stop()


def _chat(served, tenant: str, content: str, **extra):
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", **extra.pop("headers", {})}
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": content}], **extra}
    return served.client.post("/v1/chat/completions", json=body, headers=headers)


# ---------------------------------------------------------------- isolation


def test_tenant_a_reply_is_never_drafted_into_tenant_b_reply(served):
    """A generates a reply; B asks for the same text (the same prompt and seed: B's reply is A's, token
    for token). B's accepted suffix drafts equal those of D, a tenant whose store is empty; A asking
    again (the control, one tenant) drafts from its own store and accepts many."""
    prompt = "Write the launch checklist for the orbital relay, step by step."
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 48}

    def run(tenant):
        r = _chat(served, tenant, prompt, **sampled)
        assert r.status_code == 200, r.text
        data = r.json()
        return data["choices"][0]["message"]["content"], data["speculation"]

    text_a, _ = run("sa")
    text_b, spec_b = run("sb")
    text_d, spec_d = run("sd")
    text_a2, spec_a2 = run("sa")
    assert text_b == text_a == text_d == text_a2  # the same text each time: only the drafts differ
    assert spec_b["method"] == "suffix"
    assert (spec_b["accepted"], spec_b["proposed"]) == (spec_d["accepted"], spec_d["proposed"])
    assert spec_a2["accepted"] >= 24 > spec_b["accepted"] + 16, (spec_a2, spec_b)


def test_tenant_b_prefix_is_never_reused_for_tenant_a(served):
    """The same long prompt: B's request after A's prefills in full (cached_tokens 0); A's and B's
    second requests each reuse their own tenant's prefix (the control)."""
    prompt = "Summarise the incident report below for the on-call engineer. " * 12

    def cached(tenant):
        r = _chat(served, tenant, prompt, max_tokens=4, temperature=0)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("pb") == 0
    assert cached("pb") > 50  # the control: within one tenant the prefix is reused
    assert cached("pa") == 0  # B's prefix (the chat template's system prompt and P) sits in a free slot: not A's
    assert cached("pa") > 50


def test_a_conversation_id_reused_across_tenants_never_mixes_histories(served):
    """Two tenants send the same conversation id: two conversations, in the embedded provider's
    histories and in the turn tracker (two turn spans, each with its tenant)."""
    headers = {"X-OpenAlice-Conversation-Id": "shared-conv"}
    r_a = _chat(served, "a", "Tenant A's private plan: move the relay to orbit 7.", max_tokens=4, headers=headers)
    r_b = _chat(served, "b", "Tenant B asks about something else entirely.", max_tokens=4, headers=headers)
    assert r_a.status_code == r_b.status_code == 200
    local = _local_provider(served.runner)
    history_a = local._histories.get("a:shared-conv")
    history_b = local._histories.get("b:shared-conv")
    assert local._histories.get("shared-conv") is None  # never under the bare id
    engine = local.engine
    assert "orbit 7" in engine.tokenizer.decode(history_a) and "orbit 7" not in engine.tokenizer.decode(history_b)
    turns = [s for s in served.spans.get_finished_spans()
             if s.name.startswith("invoke_agent") and s.attributes.get(A.GEN_AI_CONVERSATION_ID) == "shared-conv"]
    assert sorted(s.attributes.get(A.TENANT) for s in turns) == ["a", "b"]


def test_a_conversations_open_turn_is_its_tenants_alone():
    """A turn waiting for its tool results: the same conversation id from another tenant opens a turn of
    its own; the tenant's own next request (answering the call) continues it (the control)."""
    from types import SimpleNamespace

    from openalice_runner.server.turns import TurnTracker

    tracker = TurnTracker(RunnerTelemetry(TracerProvider(), MeterProvider()))
    ask = [SimpleNamespace(role="user")]
    first = tracker.begin(conversation_id="x", turn_type="chat", agent=None, parent=None, messages=ask, tenant="a")
    tracker.finish(first, finish_reason="tool_calls", tool_calls=[("call-1", "lookup")])
    answer = [*ask, SimpleNamespace(role="tool", tool_call_id="call-1")]
    other = tracker.begin(conversation_id="x", turn_type="chat", agent=None, parent=None, messages=answer, tenant="b")
    assert other.turn is not first.turn and len(tracker) == 2
    own = tracker.begin(conversation_id="x", turn_type="chat", agent=None, parent=None, messages=answer, tenant="a")
    assert own.turn is first.turn and own.step == 3  # the call, the tool, this call


def _local_provider(runner):
    from openalice_runner.providers.local import EmbeddedProvider

    for provider in runner.providers.values():
        while not isinstance(provider, EmbeddedProvider) and hasattr(provider, "wrapped"):
            provider = provider.wrapped
        if isinstance(provider, EmbeddedProvider):
            return provider
    raise AssertionError("no local provider")


def test_adaptive_gamma_statistics_are_kept_per_tenant():
    """Tenant a's outcomes move a's γ estimates only; b still sees the prior (and without a tenant,
    the shared estimates are untouched too)."""
    from openalice_runner.policies import PolicyStore, RequestContext
    from openalice_runner.speculation import SpeculationOutcome

    store = PolicyStore.from_text(
        "version: 1\nname: auto\nadaptive: {warmup: 2}\ndefault:\n  method: ngram\n  gamma: auto\n"
        "  min_gamma: 1\n  max_gamma: 8\n"
    )
    miss = SpeculationOutcome(method="ngram", gamma=4, proposed=40, accepted=0, accept_length_histogram=[10, 0, 0, 0, 0],
                              draft_s=0.01, verify_s=0.1)  # fmt: skip
    for _ in range(5):
        store.observe("chat", "ngram", "local", miss, tenant="a")
    alpha_a, _, measured_a = store.adaptive_for("a").estimate("chat", "ngram", "local")
    alpha_b, _, measured_b = store.adaptive_for("b").estimate("chat", "ngram", "local")
    assert measured_a and alpha_a < 0.05
    assert not measured_b and alpha_b > 0.3  # the prior
    assert not store.adaptive.estimate("chat", "ngram", "local")[2]
    decided_a = store.decide(RequestContext(turn_type="chat", provider="local", tenant="a"))
    decided_b = store.decide(RequestContext(turn_type="chat", provider="local", tenant="b"))
    assert decided_a.gamma < decided_b.gamma, (decided_a, decided_b)


# ---------------------------------------------------------------- keys and tenants


def test_each_key_maps_to_its_tenant(served):
    """A tenant's own settings follow its key (here `limited`'s speculation_info summary), metrics and
    spans carry its name; a wrong key, or two headers naming two tenants, is a 401."""
    served.app.state.tenant_limiter.clock = lambda: 0.0  # no refill: this test spends one of `limited`'s two
    full = _chat(served, "c", "hello there", max_tokens=4).json()["speculation"]
    summary = _chat(served, "limited", "hello there", max_tokens=4).json()["speculation"]
    assert "accepted" in full and full["accepted"] is not None
    assert summary.get("accepted") is None and summary["method"] == "suffix"
    bad = served.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                             headers={"Authorization": "Bearer key-of-nobody-0123456789abcdef"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    mixed = served.client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['a']}", "x-api-key": KEYS["b"]})
    assert mixed.status_code == 401
    both = served.client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['b']}", "x-api-key": KEYS["b"]})
    assert both.status_code == 200
    metrics = served.client.get("/metrics").text
    assert 'openalice_tenant_requests_total{status="200",tenant="c"}' in metrics
    chats = [s for s in served.spans.get_finished_spans() if s.name.startswith("chat ")]
    assert {"c", "limited"} <= {s.attributes.get(A.TENANT) for s in chats}


def test_rate_limit_answers_429_with_retry_after_in_each_wires_shape(served):
    """`limited` may send 2 requests a minute: past them every wire answers 429 with Retry-After, in
    its own error shape, before any work."""
    limiter = served.app.state.tenant_limiter
    limiter.clock = lambda: 1000.0  # a frozen clock: no refill during the test
    limiter.forget_others([n for n in SERVED if n != "limited"])  # `limited` starts with a full bucket
    auth = {"x-api-key": KEYS["limited"]}
    assert served.client.get("/v1/models", headers=auth).status_code == 200
    assert served.client.get("/v1/models", headers=auth).status_code == 200
    chat = served.client.post("/v1/chat/completions", headers=auth,
                              json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert chat.status_code == 429 and int(chat.headers["retry-after"]) == 30
    assert chat.json()["error"]["type"] == "rate_limit_error" and chat.json()["error"]["code"] == "rate_limit_exceeded"
    messages = served.client.post("/v1/messages", headers=auth,
                                  json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert messages.status_code == 429 and messages.headers["retry-after"] == "30"
    assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "rate_limit_error"
    responses = served.client.post("/v1/responses", headers=auth, json={"input": "x"})
    assert responses.status_code == 429 and responses.headers["retry-after"] == "30"
    assert "error" in responses.json()
    limiter.clock = lambda: 1030.0  # half a minute on: one request's worth has come back
    assert served.client.get("/v1/models", headers=auth).status_code == 200
    assert served.client.get("/v1/models", headers=auth).status_code == 429
    # other tenants are not limited by it
    assert served.client.get("/v1/models", headers={"x-api-key": KEYS["a"]}).status_code == 200


def test_a_tenants_stream_release_mode_is_the_one_its_streams_leave_in(served):
    """`fx` has fixed:4 in the keys file, `a` the serve default (pass): fx's stream is padded (every
    write a comment block and a bucket's size) and holds the same text as a's."""
    from openalice_runner.bench.side_channel.observe import writes
    from openalice_runner.server.release.padding import bucket

    def stream(tenant: str) -> tuple[str, list[int]]:
        body = {"model": "tiny-random", "messages": [{"role": "user", "content": "Release test."}],
                "max_tokens": 12, "temperature": 0, "stream": True}
        with served.client.stream("POST", "/v1/chat/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as response:
            assert response.status_code == 200
            raw = response.read()
        blocks = [(0.0, b + b"\n\n") for b in raw.split(b"\n\n") if b]
        text = "".join((json.loads(b[6:]).get("choices") or [{}])[0].get("delta", {}).get("content") or ""
                       for _, b in blocks if b.startswith(b"data: {"))
        return text, [n for _, n in writes(blocks)]

    padded_text, padded = stream("fx")
    plain_text, plain = stream("a")
    assert padded_text == plain_text and padded_text
    assert all(n == bucket(n) for n in padded) and any(n != bucket(n) for n in plain)


def test_keys_file_reload_applies_a_good_edit_and_keeps_the_last_good_on_a_bad_one(served):
    watch = served.app.state.keys_watch
    path = served.keys_path
    e_auth = {"Authorization": f"Bearer {KEYS['e']}"}
    assert served.client.get("/v1/models", headers=e_auth).status_code == 401
    # a bad edit: a duplicate key (e's hash twice) and an unknown field; nothing changes
    bad = _keys_yaml(*SERVED, "e") + f"  - name: e2\n    hash: {_hash(KEYS['e'])}\n    colour: red\n"
    _write(path, bad)
    assert watch.check() is False
    assert watch.last_error and f"{path}:" in watch.last_error and "unknown key 'colour'" in watch.last_error
    assert served.client.get("/v1/models", headers=e_auth).status_code == 401
    assert served.client.get("/v1/models", headers={"x-api-key": KEYS["a"]}).status_code == 200
    health = served.client.get("/health").json()
    assert health["keys"]["last_error"].startswith("keys.yaml:")  # the position, not the problem's text
    # a good edit: e is in, d is out
    _write(path, _keys_yaml(*(n for n in SERVED if n != "d"), "e"))
    assert watch.check() is True and watch.last_error is None
    assert served.client.get("/v1/models", headers=e_auth).status_code == 200
    assert served.client.get("/v1/models", headers={"x-api-key": KEYS["d"]}).status_code == 401
    # writable by others: refused, the last good stays
    os.chmod(path, 0o666)
    assert watch.check() is False and "writable by others" in watch.last_error
    assert served.client.get("/v1/models", headers=e_auth).status_code == 200
    os.chmod(path, 0o600)
    assert watch.check() is True and watch.last_error is None
    _write(path, _keys_yaml(*SERVED))  # as the other tests expect
    assert watch.check() is True


H, H1 = _hash("first key 0123456789abcdef"), _hash("second key 0123456789abcdef")


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        (f"tenants:\n  - name: a\n    hash: {H}\n  - name: b\n    hash: {H}\n", "5:11", "duplicate key"),
        (f"tenants:\n  - name: a\n    hash: {H}\n  - name: a\n    hash: {H1}\n", "4:11", "duplicate tenant name"),
        (f"tenants:\n  - name: a\n    hash: {H}\n    colour: red\n", "4:5", "unknown key 'colour'"),
        (f"tenants:\n  - name: a\n    hash: {H}\nowner: me\n", "4:1", "unknown key 'owner'"),
        ("", "1:1", "file is empty"),
        ("# nothing yet\n", "1:1", "file is empty"),
        ("tenants: []\n", "1:10", "at least 1 item"),
        (f"tenants:\n  - name: a\n    hash: {H}\n    stream_release: fixed:0\n", "4:21", "N a whole number from 1"),
        (f"tenants:\n  - name: a\n    hash: {H}\n    stream_release: burst\n", "4:21", "pass, fixed:N"),
        (f"tenants:\n  - name: a\n    hash: {H}\n    speculation_info: most\n", "4:23", "'full', 'summary' or 'none'"),
        (f"tenants:\n  - name: a\n    hash: {H}\n    requests_per_minute: 0\n", "4:26", "greater than or equal to 1"),
        (f"tenants:\n  - name: a\n    hash: {H}\n    requests_per_minute: true\n", "4:26", "valid integer"),
        ("tenants:\n  - name: a\n    hash: my-secret-key\n", "3:11", "64 hex digits"),
        (f"tenants:\n  - name: 'a b'\n    hash: {H}\n", "2:11", "a tenant name is"),
        (f"tenants:\n  - name: other\n    hash: {H}\n", "2:11", "reserved"),
        (f"tenants:\n  - hash: {H}\n", "2:5", "missing required key"),
        ("tenants:\n  - name: [a\n", "3:1", "YAML syntax"),
    ],
)
def test_keys_file_bad_inputs_are_refused_at_file_line_col(text, where, says):
    with pytest.raises(KeysFileError) as raised:
        load_keys_text(text, "keys.yaml")
    assert f"keys.yaml:{where}: " in str(raised.value) and says in str(raised.value), str(raised.value)


def test_a_good_keys_file_loads_each_tenants_settings():
    entries = load_keys_text(
        f"tenants:\n  - name: a\n    hash: {H.upper()}\n    stream_release: fixed:16\n    speculation_info: none\n"
        f"    requests_per_minute: 30\n  - name: b\n    hash: {H1}\n    stream_release: paced\n"
    )
    (hash_a, a), (_, b) = entries
    assert hash_a == H  # hex read in any case, kept in lower case
    assert (str(a.stream_release), a.speculation_info, a.requests_per_minute) == ("fixed:16", "none", 30)
    assert (a.stream_release.kind, a.stream_release.n) == ("fixed", 16)
    assert (str(b.stream_release), b.speculation_info, b.requests_per_minute) == ("paced", None, None)


def test_a_keys_file_writable_by_others_is_refused(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"tenants:\n  - name: a\n    hash: {H}\n")
    os.chmod(path, 0o620)
    with pytest.raises(KeysFileError, match=r"keys.yaml:1:1: writable by others \(mode 620\)"):
        load_keys_file(path)
    os.chmod(path, 0o644)  # readable by others is fine: it holds hashes only
    assert [t.name for _, t in load_keys_file(path)] == ["a"]


def test_request_settings_take_the_tenants_else_the_serve_defaults():
    from openalice_runner.server.release.modes import parse_release
    from openalice_runner.server.tenants import Tenant, request_settings

    settings = ServerSettings(speculation_info="summary")
    assert request_settings(None, settings).speculation_info == "summary"
    assert request_settings(None, settings).tenant is None
    own = request_settings(Tenant("a", parse_release("fixed:4"), "none"), settings)
    assert (own.tenant, own.speculation_info, str(own.stream_release)) == ("a", "none", "fixed:4")
    plain = request_settings(Tenant("b"), settings)
    assert (plain.tenant, plain.speculation_info, str(plain.stream_release)) == ("b", "summary", "pass")


def test_api_key_is_the_one_tenant_default_and_not_with_a_keys_file(tmp_path):
    from openalice_runner.server.guard import GuardMiddleware
    from openalice_runner.server.metrics import ServerMetrics

    guard = GuardMiddleware(None, api_key="k" * 20, max_body_bytes=1024, metrics=ServerMetrics())
    assert guard.tenants.find(b"k" * 20).name == "default"
    assert guard.tenants.find(b"k" * 19) is None
    keys = tmp_path / "keys.yaml"
    _write(keys, _keys_yaml("a"))
    with pytest.raises(ValueError, match="an API key and a keys file together"):
        create_app(object(), settings=ServerSettings(api_key="k" * 20, keys_file=str(keys)))


def test_serve_refuses_keys_with_api_key_and_a_bad_keys_file(tmp_path, capsys, restore_logging):
    from openalice_runner.cli import main

    keys = tmp_path / "keys.yaml"
    _write(keys, _keys_yaml("a"))
    assert main(["serve", "--keys", str(keys), "--api-key", "k" * 20]) == 2
    assert "--keys and --api-key together" in capsys.readouterr().err
    _write(keys, "tenants:\n  - name: a\n")
    assert main(["serve", "--keys", str(keys)]) == 2
    assert f"{keys}:2:5: tenants.0.hash: missing required key" in capsys.readouterr().err


def test_keys_hash_prints_the_hash_of_the_key_read_from_stdin(monkeypatch, capsys):
    from openalice_runner.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(KEYS["a"] + "\n"))
    assert main(["keys", "hash"]) == 0
    assert capsys.readouterr().out.strip() == _hash(KEYS["a"])
    monkeypatch.setattr("sys.stdin", io.StringIO("short\n"))
    assert main(["keys", "hash"]) == 2


# ---------------------------------------------------------------- pools


async def test_vllm_pool_request_body_carries_the_tenants_cache_salt():
    """The tenant goes upstream as vLLM's `cache_salt` (its per-request prefix-cache isolation): derived
    from the tenant's name, never its key; the same for the same tenant, another for another; none
    without a tenant. The conversation id upstream (gateway affinity) is scoped by the tenant too."""
    from openalice_runner.providers.base import CallContext
    from openalice_runner.providers.pools.upstream import cache_salt
    from openalice_runner.providers.pools.vllm.provider import VLLMConfig, VLLMProvider
    from openalice_runner.types import ChatRequest

    sent: list[tuple[dict, httpx.Headers]] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(404)
        sent.append((json.loads(request.content), request.headers))
        return httpx.Response(200, json={
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        })  # fmt: skip

    cfg = VLLMConfig.model_validate({"type": "vllm", "model": "m", "pools": {"main": {"replicas": ["http://v1"]}}})
    provider = VLLMProvider("cpu", cfg, client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    request = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    for tenant in ("a", "a", "b", None):
        await provider.chat(request, CallContext(tenant=tenant, conversation_id="c1"))
    salts = [body.get("cache_salt") for body, _ in sent]
    assert salts[0] == salts[1] == cache_salt("a") and salts[2] == cache_salt("b") and salts[3] is None
    assert salts[0] != salts[2] and len(salts[0]) == 43  # 256 bits, base64url, as vLLM asks
    assert [h["x-openalice-conversation-id"] for _, h in sent] == ["a:c1", "a:c1", "b:c1", "c1"]
    await provider.aclose()


# ---------------------------------------------------------------- the engine, directly


def test_the_serial_engine_reuses_a_prefix_within_its_tenant_only():
    """max_batch 1 (the serial loop, one held prefix): the tenant that left it reuses it, another not."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from openalice_runner.engine import Engine
    from openalice_runner.engine.types import SamplingParams

    engine = Engine.tiny_random(seed=0, max_batch=1, prefix_reuse=True)
    ids = engine.render_chat([{"role": "user", "content": "List the relay's failure modes. " * 6}])
    sampling = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(tenant):
        return engine.generate(ids, sampling, tenant=tenant).stats.cached_prompt_tokens

    assert cached("a") == 0
    assert cached("a") > 40  # the control
    assert cached("b") == 0
    assert cached("b") > 40


def test_the_suffix_store_is_one_per_tenant_and_bounded():
    from openalice_runner.engine.drafters.suffix import TenantResponses

    stores = TenantResponses(max_tenants=2)
    a, b = stores.of("a"), stores.of("b")
    assert a is stores.of("a") and a is not b and stores.of(None) is not a
    assert len(stores) == 2  # "b" went first: "a" was used after it
    assert stores.of("a") is a and stores.of("b") is not b


# ---------------------------------------------------------------- `serve --keys`, a real process


def test_serve_keys_as_a_process_maps_keys_and_reloads_the_file(tmp_path):
    """The CLI wiring end to end: `serve --keys` lets a listed key in and no other, applies a valid
    edit of the file while serving and keeps the last good tenants on a broken one."""
    import time

    from support.serve_process import TINY, Serve

    keys = tmp_path / "keys.yaml"
    _write(keys, _keys_yaml("a"))
    serve = Serve(tmp_path, TINY + "routes:\n  - {name: default, chain: [local]}\n", "--keys", str(keys),
                  env={"OPENALICE_API_KEY": ""})  # fmt: skip

    def status(tenant):
        return httpx.get(f"{serve.url}/v1/models", headers={"x-api-key": KEYS[tenant]}, timeout=5).status_code

    def wait_for(predicate, what):
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.1)

    try:
        assert (status("a"), status("e")) == (200, 401)
        _write(keys, _keys_yaml("a", "e"))
        wait_for(lambda: status("e") == 200, "the valid edit did not apply")
        _write(keys, _keys_yaml("a", "e") + "  - name: x\n")
        wait_for(lambda: "last_error" in httpx.get(f"{serve.url}/health", timeout=5).json()["keys"],
                 "the broken edit was not reported")  # fmt: skip
        assert (status("a"), status("e")) == (200, 200)  # the last good tenants
        assert "keys file rejected" in serve.log() and f"{keys}:6:5: tenants.2.hash: missing required key" in serve.log()
        assert serve.terminate(timeout=30) == 0
    finally:
        if serve.proc.poll() is None:
            serve.terminate()

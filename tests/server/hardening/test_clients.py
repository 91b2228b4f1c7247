"""Issue 23's hostile-client findings, over real HTTP on loopback: bounded metric labels and an
off-loop /metrics (1), request-level errors that name their field (4), and model names that no
route takes (6). The server runs the embedded engine's tiny random model."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from locations import REPO
from opentelemetry.trace import SpanKind
from support.tiny_stack import AUTH, HI, TOOL, Stack, openai_error

from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.tracing.labels import MAX_DISTINCT, STANDARD_TURN_TYPES


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.server.stop()


def _label_values(text: str, label: str) -> set[str]:
    values = set()
    for line in text.splitlines():
        for sep in ("{", ","):  # the label itself, not one whose name ends the same
            if not line.startswith("#") and f'{sep}{label}="' in line:
                values.add(line.split(f'{sep}{label}="', 1)[1].split('"', 1)[0])
    return values


# ---- 1: metric labels from clients stay bounded; /metrics renders off the event loop


def test_client_turn_types_and_models_do_not_mint_metric_labels(stack):
    # Real completions: the chat_completions counter and the GenAI histograms see these.
    for i in range(6):
        headers = {"X-OpenAlice-Turn-Type": f"made-up-{i}"}
        assert stack.post({"messages": HI, "max_tokens": 1}, headers).status_code == 200
    assert stack.post({"messages": HI, "max_tokens": 1}, {"X-OpenAlice-Turn-Type": "agentic"}).status_code == 200
    for method in ("PROPFIND", "MKCOL", "LOCK", "UNLOCK"):  # methods the HTTP parser takes, we do not serve
        httpx.request(method, f"{stack.url}/v1/policy", headers=AUTH, timeout=30)
    # Then many cheap requests, each with a turn type of its own, ending in 408 (as in the probe);
    # the first few add the series a 408 has (status, outcome, error type), the rest must add none.
    with httpx.Client(headers=AUTH, timeout=60) as client:
        for i in range(80):
            if i == 8:
                size_before = len(stack.scrape())
            headers = {"X-OpenAlice-Turn-Type": f"junk-{i}", "X-OpenAlice-Timeout": "0.000001"}
            body = {"messages": HI, "max_tokens": 1, "metadata": {"turn_type": f"meta-{i}"}}
            r = client.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers)
            assert r.status_code in (200, 408), r.text
    text = stack.scrape()
    assert _label_values(text, "method") == {"GET", "POST", "other"}
    allowed = STANDARD_TURN_TYPES | {"agentic"}  # the configured set: standard ones plus the routes'
    assert _label_values(text, "turn_type") <= allowed
    assert _label_values(text, "openalice_turn_type") <= allowed  # the GenAI histograms' label
    assert "other" in _label_values(text, "turn_type") and "agentic" in _label_values(text, "turn_type")
    assert len(text) < size_before * 1.05  # counts grew; the series did not


def test_model_and_tool_name_labels_are_capped():
    from openalice_runner.tracing import attributes as A
    from openalice_runner.tracing.labels import LabelBounds

    bounds = LabelBounds()
    seen = {bounds.bound({A.GEN_AI_REQUEST_MODEL: f"m{i}"})[A.GEN_AI_REQUEST_MODEL] for i in range(500)}
    assert len(seen) == MAX_DISTINCT + 1 and "other" in seen
    assert bounds.bound({A.GEN_AI_REQUEST_MODEL: "m3"})[A.GEN_AI_REQUEST_MODEL] == "m3"  # kept ones stay
    tools = {bounds.bound({A.GEN_AI_TOOL_NAME: f"t{i}"})[A.GEN_AI_TOOL_NAME] for i in range(500)}
    assert len(tools) == MAX_DISTINCT + 1
    strict = LabelBounds(turn_types=lambda: {"mine"})
    assert [strict.turn_type(t) for t in ("chat", "mine", "yours")] == ["chat", "mine", "other"]


def test_metrics_render_in_a_worker_thread_and_concurrent_scrapes_leave_health_answering(stack):
    threads: list[int] = []
    real_render = stack.metrics.render

    def render():
        threads.append(threading.get_ident())
        return real_render()

    stack.metrics.render = render
    try:
        results: list[int] = []
        scrapers = [
            threading.Thread(
                target=lambda: results.append(
                    httpx.get(f"{stack.url}/metrics", headers=AUTH, timeout=60).status_code
                )
            )
            for _ in range(8)
        ]
        for t in scrapers:
            t.start()
        health = httpx.get(f"{stack.url}/health", timeout=60)
        for t in scrapers:
            t.join(60)
    finally:
        del stack.metrics.render
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert results == [200] * 8
    assert threads and stack.server.thread.ident not in threads  # never on the event loop's thread


def test_concurrent_scrapes_share_one_render():
    metrics = ServerMetrics()
    calls = []
    gate = threading.Event()
    real_render = metrics.render

    def slow_render():
        calls.append(1)
        gate.wait(10)
        return real_render()

    metrics.render = slow_render
    out: list[bytes] = []
    first = threading.Thread(target=lambda: out.append(metrics.scrape()))
    first.start()
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:  # the first scrape is rendering; others arrive now
        time.sleep(0.01)
    assert calls
    threads = [threading.Thread(target=lambda: out.append(metrics.scrape())) for _ in range(5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(metrics._scrape_cond._waiters) < 5 and time.monotonic() < deadline:  # all five wait
        time.sleep(0.01)
    gate.set()
    for t in [first, *threads]:
        t.join(10)
    assert len(out) == 6 and len(set(out)) == 1 and len(calls) == 1
    metrics.scrape()
    assert len(calls) == 2  # one after another: each scrape renders afresh
    metrics.scrape(max_age_s=60)
    assert len(calls) == 2  # unless asked to reuse a recent render


def test_metrics_need_the_api_key_unless_public(stack):
    assert openai_error(httpx.get(f"{stack.url}/metrics", timeout=10), 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200  # liveness stays open
    public = Stack(metrics_public=True)
    try:
        assert httpx.get(f"{public.url}/metrics", timeout=10).status_code == 200
    finally:
        public.server.stop()


# ---- 4: request-level errors name their field


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": HI, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice", "'g', which is not in tools"),
        ({"messages": HI, "tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        ({"messages": HI, "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
            "mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}},
                                      {"type": "function", "function": {"name": "g"}}]}}},
         "tool_choice.allowed_tools.tools[1].function.name", "'g', which is not in tools"),
        ({"messages": HI, "tools": [TOOL], "tool_choice": {"type": "allowed_tools", "allowed_tools": {
            "mode": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}}},
         "tool_choice.allowed_tools.mode", "Input should be 'auto' or 'required'"),
        ({"messages": HI, "tools": [TOOL, {**TOOL, "function": {**TOOL["function"], "name": "h"}}, TOOL]},
         "tools[2].function.name", "duplicate function name 'f'"),
        ({"messages": HI, "max_tokens": 3, "max_completion_tokens": 4}, "max_tokens", "disagree"),
    ],
)  # fmt: skip
def test_request_level_checks_name_their_field(stack, body, param, words):
    err = openai_error(stack.post(body), 400)
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert words in err["message"] and "JSON object" not in err["message"]


def test_invalid_utf8_says_where(stack):
    raw = b'{"messages": [{"role": "user", "content": "ok \xff\xfe bad"}]}'
    err = openai_error(stack.post(raw), 400)
    assert err["code"] == "invalid_utf8" and err["param"] == "messages[0].content", err
    assert "not valid UTF-8" in err["message"] and "0xff" in err["message"]
    err = openai_error(stack.post(b'{"messages": [\xff'), 400)  # not JSON past the bad byte: no field to name
    assert err["code"] == "invalid_utf8" and err["param"] is None


@pytest.mark.parametrize("field", ["temperature", "top_p", "timeout"])
@pytest.mark.parametrize("value", [b"NaN", b"Infinity"])
def test_nan_and_infinity_are_not_finite_numbers(stack, field, value):
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "%s": %s}' % (field.encode(), value)
    err = openai_error(stack.post(raw), 400)
    assert err["param"] == field and "finite number" in err["message"], err


def test_a_body_that_is_not_an_object_still_says_so(stack):
    err = openai_error(stack.post(b'"just a string"'), 400)
    assert err["code"] == "invalid_body"


# ---- 6: models


def test_unknown_model_is_404_model_not_found(stack):
    err = openai_error(stack.post({"model": "gpt-nope", "messages": HI, "max_tokens": 1}), 404)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "'gpt-nope'" in err["message"]
    err = openai_error(stack.post({"model": "gpt-nope", "messages": HI, "stream": True}), 404)
    assert err["code"] == "model_not_found"


def test_served_and_listed_names_are_served_and_the_response_says_what_served_them(stack):
    stack.spans.clear()
    for requested in ("tiny-random", "alias-x", None):
        body = {"messages": HI, "max_tokens": 1, **({"model": requested} if requested else {})}
        r = stack.post(body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "tiny-random"  # what served it
    chats = [s for s in stack.spans.get_finished_spans() if s.kind == SpanKind.CLIENT]
    requested = [s.attributes.get("gen_ai.request.model") for s in chats]
    assert "alias-x" in requested  # the request's name stays in the span
    assert {s.attributes.get("gen_ai.response.model") for s in chats} == {"tiny-random"}


def test_get_model_by_id(stack):
    listed = [m["id"] for m in httpx.get(f"{stack.url}/v1/models", headers=AUTH).json()["data"]]
    assert listed == ["alias-x", "tiny-random"]
    for name in listed:
        r = httpx.get(f"{stack.url}/v1/models/{name}", headers=AUTH)
        assert r.status_code == 200 and r.json()["id"] == name and r.json()["object"] == "model"
    err = openai_error(httpx.get(f"{stack.url}/v1/models/gpt-nope", headers=AUTH), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert httpx.get(f"{stack.url}/v1/models/tiny-random").status_code == 401  # keyed like /v1/models


def test_default_providers_file_states_its_catch_all():

    from openalice_runner.providers.config import CATCH_ALL_MODEL, RoutingConfig, load_routing_file

    repo = REPO
    routing = load_routing_file(repo / "providers" / "default.yaml")
    assert routing.routes[-1].match.models == [CATCH_ALL_MODEL]
    assert routing.route_for("chat", "any-name-at-all", {"local": ["tiny-random"]}).name == "default"
    assert RoutingConfig.default().routes == routing.routes  # the built-in default routes the same
    packaged = repo / "openalice_runner" / "defaults" / "providers.yaml"
    if packaged.exists():
        assert packaged.read_text() == (repo / "providers" / "default.yaml").read_text()


def test_stream_error_bodies_are_json(stack):
    r = stack.post({"model": "alias-x", "messages": HI, "max_tokens": 2, "stream": True})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events and all(e["model"] == "tiny-random" for e in events)

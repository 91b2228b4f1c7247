"""The sidecar under overload, deadlines, clients that leave, and bad input: real HTTP on loopback.

The embedded engine is the tiny random model behind a spy that can hold requests at a gate (to fill
the admission slots deterministically) and slow each decode step, and that records how each
generation ended and how many rounds ran after its cancel event was set.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from stand_ins.engines import tiny_engine
from support.live_server import LiveServer, metric_sample, wait_for

from openalice_runner.providers.config import load_routing_text
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app

HI = [{"role": "user", "content": "hi"}]
STOPPED = ("cancelled", "closed")  # how a generation that was stopped early ends


def _held_at(fn, call: int, held: threading.Event, resume: threading.Event):
    """`fn`, whose `call`-th call sets `held` and waits for `resume` (bounded: a test that never
    resumes fails instead of hanging the engine)."""
    calls = {"n": 0}

    def holding(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            held.set()
            assert resume.wait(60), "the test never resumed the model"
        return fn(*args, **kwargs)

    return holding


class SpyEngine:
    """The tiny engine, with a gate before each generation and an optional delay per decode round.
    A run ends "cancelled" (the engine saw its cancel event) or "closed" (its generator was closed)."""

    def __init__(self, real) -> None:
        self.real = real
        self.open = threading.Event()
        self.open.set()
        self.step_delay = 0.0
        self.runs: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def stream(self, prompt_ids, sampling, spec, cancel=None, grammar=None):
        run = {"rounds_after_cancel": 0, "finish": None, "tokens": 0, "ended_at": None, "cancel": cancel}
        self.runs.append(run)
        while not self.open.wait(0.01):
            if cancel is not None and cancel.is_set():
                break
        try:
            for event in self.real.stream(prompt_ids, sampling, spec, cancel, grammar=grammar):
                if event.result is not None:
                    run["finish"] = event.result.finish_reason
                    run["tokens"] = len(event.result.token_ids)
                elif cancel is not None and cancel.is_set():
                    run["rounds_after_cancel"] += 1
                if self.step_delay:
                    time.sleep(self.step_delay)
                yield event
        except GeneratorExit:  # the provider closed the stream: the engine's generator closes with it
            run["finish"] = run["finish"] or "closed"
            raise
        finally:
            run["ended_at"] = time.monotonic()

    def generate(self, prompt_ids, sampling, spec, cancel=None):
        result = None
        for event in self.stream(prompt_ids, sampling, spec, cancel):
            result = event.result or result
        return result


PROVIDERS = """
providers:
  local: {type: local, tiny_random: true, max_tokens_default: 8, max_in_flight: 1, max_queue: 1}
routes:
  - {name: default, chain: [local]}
"""


class Stack:
    def __init__(self) -> None:
        self.engine = SpyEngine(tiny_engine())
        self.runner = Runner.from_config(
            providers=load_routing_text(PROVIDERS), policy=False, telemetry=False, engine=self.engine
        )
        settings = ServerSettings(max_body_bytes=256 * 1024, request_timeout_s=30, max_tokens_limit=4096)
        self.server = LiveServer(create_app(self.runner, settings=settings)).start()
        self.url = self.server.url
        self.chat_url = f"{self.url}/v1/chat/completions"

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def post(self, body, headers=None, timeout=60, **kw) -> httpx.Response:
        if isinstance(body, dict):
            return httpx.post(self.chat_url, json=body, headers=headers, timeout=timeout, **kw)
        return httpx.post(self.chat_url, content=body, headers=headers, timeout=timeout, **kw)

    def idle(self) -> str:
        """Waits for every slot, queue place and KV position to come back; returns the scrape."""
        return wait_for(
            self.metrics,
            lambda t: (
                metric_sample(t, "openalice_provider_requests_in_flight", provider="local") == 0
                and metric_sample(t, "openalice_provider_requests_queued", provider="local") == 0
                and metric_sample(t, "openalice_requests_in_flight") == 0
                and metric_sample(t, "openalice_engine_kv_tokens_in_use", provider="local") == 0
            ),
        )


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.engine.open.set()
    s.server.stop()


@pytest.fixture(autouse=True)
def _reset(stack):
    stack.engine.open.set()
    stack.engine.step_delay = 0.0
    yield
    stack.engine.open.set()
    stack.engine.step_delay = 0.0


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target():
        try:
            out["response"] = fn(*args, **kwargs)
        except Exception as exc:  # reported by the test that reads it
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def _wait_gauges(stack, in_flight: int, queued: int) -> None:
    wait_for(
        stack.metrics,
        lambda t: (
            metric_sample(t, "openalice_provider_requests_in_flight", provider="local") == in_flight
            and metric_sample(t, "openalice_provider_requests_queued", provider="local") == queued
        ),
    )


# ---------------------------------------------------------------- admission


def test_past_slots_and_queue_requests_are_refused_at_once_with_retry_after(stack):
    stack.engine.open.clear()
    body = {"messages": HI, "max_tokens": 2}
    held = [_in_background(stack.post, body) for _ in range(2)]  # one running, one queued
    _wait_gauges(stack, 1, 1)
    before = metric_sample(stack.metrics(), "openalice_provider_requests_refused_total", provider="local")
    for stream in (False, True):
        r = stack.post({**body, "stream": stream})
        # at once, not after a wait for a slot: the held requests still hold theirs (the gate is shut)
        assert all(thread.is_alive() for thread, _ in held)
        err = _error(r, 429)
        assert err["type"] == "rate_limit_error" and err["code"] == "server_busy"
        assert int(r.headers["Retry-After"]) >= 1
    text = stack.metrics()
    assert metric_sample(text, "openalice_provider_requests_refused_total", provider="local") == before + 2
    assert metric_sample(text, "openalice_chat_completions_total", outcome="refused") >= 2
    stack.engine.open.set()
    for thread, out in held:
        thread.join(60)
        assert out["response"].status_code == 200, out
    stack.idle()


def test_limits_show_in_metrics(stack):
    text = stack.metrics()
    assert metric_sample(text, "openalice_provider_max_in_flight", provider="local") == 1
    assert metric_sample(text, "openalice_provider_max_queue", provider="local") == 1


# ---------------------------------------------------------------- deadlines


def test_deadline_ends_a_running_and_a_queued_request_and_frees_their_slots(stack):
    stack.engine.open.clear()
    runs = len(stack.engine.runs)
    before = metric_sample(stack.metrics(), "openalice_requests_cancelled_total", reason="deadline")
    running = _in_background(stack.post, {"messages": HI, "max_tokens": 2, "timeout": 6})
    _wait_gauges(stack, 1, 0)
    t0 = time.monotonic()
    queued = stack.post({"messages": HI, "max_tokens": 2}, headers={"X-OpenAlice-Timeout": "0.4"})
    assert time.monotonic() - t0 > 0.3  # not before its deadline
    # ended by its own deadline, not by the slot coming free: the running one still holds it
    assert running[0].is_alive()
    err = _error(queued, 408)
    assert err["code"] == "deadline_exceeded" and err["type"] == "timeout_error"
    assert "timeout" in err["message"]
    running[0].join(30)
    assert _error(running[1]["response"], 408)["code"] == "deadline_exceeded"
    text = stack.idle()  # both slots and the queue place came back
    assert metric_sample(text, "openalice_requests_cancelled_total", reason="deadline") == before + 2
    assert metric_sample(text, "openalice_chat_completions_total", outcome="deadline") >= 2
    # The running one reached the engine, which stopped on its cancel event; the queued one never did.
    new = stack.engine.runs[runs:]
    assert len(new) == 1
    wait_for(lambda: new[0]["ended_at"], lambda v: v is not None)
    assert new[0]["finish"] == "cancelled"
    stack.engine.open.set()
    assert stack.post({"messages": HI, "max_tokens": 2}).status_code == 200


def test_server_cap_bounds_the_client_deadline(stack):
    app_settings = ServerSettings(request_timeout_s=0.3)
    runner = Runner.from_config(
        providers=load_routing_text(PROVIDERS), policy=False, telemetry=False, engine=stack.engine
    )
    server = LiveServer(create_app(runner, settings=app_settings)).start()
    try:
        stack.engine.open.clear()
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI, "timeout": 100}, timeout=30)
        err = _error(r, 408)
        assert "server's request timeout of 0.3 s" in err["message"]
    finally:
        stack.engine.open.set()
        server.stop()


def test_deadline_mid_stream_ends_it_with_an_error_event_and_stops_the_engine(stack):
    stack.engine.step_delay = 0.05
    with httpx.stream(
        "POST",
        stack.chat_url,
        json={"messages": HI, "max_tokens": 400, "stream": True},
        headers={"X-OpenAlice-Timeout": "1.0"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] != "[DONE]"
    last = json.loads(events[-1])
    assert last["error"]["code"] == "deadline_exceeded"
    assert any(json.loads(e).get("choices") for e in events[:-1])  # it streamed before the deadline
    run = stack.engine.runs[-1]
    wait_for(lambda: run["ended_at"], lambda v: v is not None)
    assert run["finish"] in STOPPED and run["rounds_after_cancel"] <= 1 and run["tokens"] < 400
    stack.idle()


@pytest.mark.parametrize("value", ["soon", "0", "-1", "nan", "inf"])
def test_bad_timeout_header_is_a_400(stack, value):
    err = _error(stack.post({"messages": HI}, headers={"X-OpenAlice-Timeout": value}), 400)
    assert err["param"] == "timeout"


# ---------------------------------------------------------------- cancellation


def test_client_leaving_mid_stream_stops_the_engine_within_one_round(stack):
    stack.engine.step_delay = 0.02
    before = metric_sample(stack.metrics(), "openalice_requests_cancelled_total", reason="client_gone")
    with httpx.stream(
        "POST", stack.chat_url, json={"messages": HI, "max_tokens": 1000, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                # The KV positions of the running generation show while it runs.
                assert metric_sample(stack.metrics(), "openalice_engine_kv_tokens_in_use", provider="local") > 0
                # the client leaves from here: the server may see the connection go while httpx is
                # still closing it (seen: the run ended 3.5 ms before the `with` block returned)
                left_at = time.monotonic()
                break  # leaving the iterator closes the connection (httpx)
    run = stack.engine.runs[-1]
    wait_for(lambda: run["ended_at"], lambda v: v is not None, timeout=60)
    assert run["finish"] in STOPPED
    assert run["rounds_after_cancel"] <= 1 and run["ended_at"] >= left_at  # within one round of leaving
    assert run["tokens"] < 1000
    text = stack.idle()  # slot, gauge and KV positions all back
    assert metric_sample(text, "openalice_requests_cancelled_total", reason="client_gone") == before + 1


def test_client_leaving_a_plain_request_stops_its_generation_too(stack, monkeypatch):
    """A plain (non-stream) request whose client goes mid-generation: the server sees the socket
    close and cancels the generation, which stops within one round. Driven by events, not a client
    timeout: the model holds in its second pass (the reply under way) while the client leaves, so
    the reply cannot finish first (an idle machine decoded all 1000 tokens within the old 0.8 s),
    and the leaving happens while the run is certainly mid-way (the race the stream variant had)."""
    held, resume = threading.Event(), threading.Event()
    model = stack.engine.real.model
    for name in ("forward", "forward_rows"):
        if hasattr(model, name):
            monkeypatch.setattr(model, name, _held_at(getattr(model, name), 2, held, resume))
    before = metric_sample(stack.metrics(), "openalice_requests_cancelled_total", reason="client_gone")
    runs = len(stack.engine.runs)
    body = json.dumps({"messages": HI, "max_tokens": 1000}).encode()
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
                         b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\n\r\n" + body)  # fmt: skip
            assert held.wait(60), "the generation never reached its second pass"
            run = stack.engine.runs[runs]
            assert not run["cancel"].is_set() and run["ended_at"] is None  # mid-way, nobody stopped it yet
        # the client has left: the server must cancel the generation on its own
        assert run["cancel"].wait(60), "the server never cancelled the generation of a client that left"
    finally:
        resume.set()
    wait_for(lambda: run["ended_at"], lambda v: v is not None, timeout=60)
    assert run["finish"] in STOPPED and run["rounds_after_cancel"] <= 1  # within one round of leaving
    assert run["tokens"] < 1000
    text = stack.idle()
    assert metric_sample(text, "openalice_requests_cancelled_total", reason="client_gone") == before + 1


# ---------------------------------------------------------------- bad input: 4xx naming the field


LONG_PROMPT = " ".join(f"w{i}" for i in range(2500))  # about 5000 tokens: past the tiny model's 2048


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b'{"messages": [', 400, None, "invalid_json"),
        (b'"just a string"', 400, None, "invalid_body"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None, None),
        ({"messages": "hi"}, 400, "messages", "invalid_value"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_value"),
        ({"messages": HI, "max_tokens": "many"}, 400, "max_tokens", "invalid_value"),
        ({"messages": HI, "temperature": 9}, 400, "temperature", "invalid_value"),
        ({"messages": HI, "stream": "yes please"}, 400, "stream", "invalid_value"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
        ({"messages": []}, 400, "messages", "invalid_value"),
        (
            {"messages": [*HI, {"role": "tool", "tool_call_id": "call_9", "content": "42"}]},
            400,
            "messages[1].tool_call_id",
            "invalid_value",
        ),
        (
            {
                "messages": [
                    *HI,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "a"},
                    {"role": "tool", "tool_call_id": "c1", "content": "again"},
                ]
            },
            400,
            "messages[3].tool_call_id",
            "invalid_value",
        ),  # fmt: skip
        ({"messages": HI, "max_tokens": 10**9}, 400, "max_tokens", "invalid_value"),
        ({"messages": HI, "max_completion_tokens": 10**6}, 400, "max_completion_tokens", "invalid_value"),
        # a max_tokens past the context is clamped now, not refused (tests/server/test_context_budget.py)
        (
            {"messages": [{"role": "user", "content": LONG_PROMPT}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        (
            {"messages": [{"role": "user", "content": "x" * 200_000}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        ({"messages": HI, "timeout": -3}, 400, "timeout", "invalid_value"),
        ({"messages": HI, "timeout": "soon"}, 400, "timeout", "invalid_value"),
        ({"messages": HI, "n": 3}, 400, "n", "invalid_value"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field_and_never_reaches_the_engine(stack, body, status, param, code):
    runs = len(stack.engine.runs)
    headers = {"Content-Type": "application/json"} if isinstance(body, bytes) else None
    err = _error(stack.post(body, headers=headers), status)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    assert len(stack.engine.runs) == runs


def test_lone_surrogate_is_refused_naming_the_field(stack):
    raw = b'{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}'
    err = _error(stack.post(raw, headers={"Content-Type": "application/json"}), 400)
    assert err["param"] == "messages[0].content" and err["code"] == "invalid_unicode"


def test_oversized_body_is_a_413(stack):
    err = _error(stack.post({"messages": [{"role": "user", "content": "x" * 300_000}]}), 413)
    assert err["code"] == "body_too_large"


def test_after_all_that_the_server_still_serves(stack):
    r = stack.post({"messages": HI, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
    stack.idle()

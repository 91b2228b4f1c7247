"""Faults survived, over real sockets on loopback: upstream providers that refuse connections, hang,
answer garbage or die mid-stream; a broken policy file while serving. Each gets a fallback where the
route has one and a clean OpenAI-shaped error where it does not, and the server keeps serving."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from locations import REPO
from stand_ins.engines import tiny_engine
from support.live_server import LiveServer, metric_sample, wait_for

from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from tests.stand_ins.openai_server import OpenAIStandIn
from tests.stand_ins.serve import ServerThread, refused_url

PROVIDER_KEY = "sk-upstream-secret-0123456789abcdef"
HI = [{"role": "user", "content": "hi"}]


def garbage_app() -> FastAPI:
    """Answers 200 with what is not an OpenAI body: HTML, and an SSE stream of broken JSON."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("stream"):

            async def events():
                yield b"data: {this is not json\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return PlainTextResponse("<html>502 from some proxy</html>", media_type="application/json")

    return app


def key_echo_app() -> FastAPI:
    """Refuses every key, echoing it back in the message (as real APIs partly do)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        key = request.headers.get("authorization", "")
        return JSONResponse(
            {"error": {"message": f"Incorrect API key provided: {key}", "type": "invalid_request_error",
                       "param": None, "code": "invalid_api_key"}},
            status_code=401,
        )  # fmt: skip

    return app


def _hosted(name: str, url: str, timeout: float = 2.0) -> str:
    return (
        f"  {name}: {{type: hosted, model: openai/stand-in, api_base: '{url}', api_key_env: FAULT_KEY,"
        f" max_retries: 0, timeout_s: {timeout}, first_token_timeout_s: {timeout}}}\n"
    )


class FaultStack:
    def __init__(self, tmp: Path) -> None:
        self.hang = OpenAIStandIn()
        self.hang.faults.delay_s = 30.0  # answers long after anyone waits
        self.hang.start()
        self.dying = OpenAIStandIn()
        self.dying.faults.break_after_chunks = 2
        self.dying.start()
        self.garbage = ServerThread(garbage_app()).start()
        self.echo = ServerThread(key_echo_app()).start()
        routes = {
            "refused": ["dead"], "refused_fb": ["dead", "local"],
            "hang": ["hang"], "hang_fb": ["hang", "local"],
            "garbage": ["garbage"], "garbage_fb": ["garbage", "local"],
            "dying": ["dying", "local"], "echo": ["echo"],
        }  # fmt: skip
        text = "providers:\n  local: {type: local, tiny_random: true, max_tokens_default: 4}\n"
        text += _hosted("dead", f"{refused_url()}/v1")
        text += _hosted("hang", self.hang.url, timeout=0.5)
        text += _hosted("garbage", f"{self.garbage.url}/v1")
        text += _hosted("dying", self.dying.url)
        text += _hosted("echo", f"{self.echo.url}/v1")
        text += "routes:\n"
        for turn_type, chain in routes.items():
            text += f"  - {{name: {turn_type}, match: {{turn_types: [{turn_type}]}}, chain: [{', '.join(chain)}]}}\n"
        text += "  - {name: default, chain: [local]}\n"
        self.providers_path = tmp / "providers.yaml"
        self.providers_path.write_text(text)
        self.policy_path = tmp / "policy.yaml"
        shutil.copy(REPO / "policies" / "default.yaml", self.policy_path)
        self.runner = Runner.from_config(
            providers=str(tmp / "providers.yaml"), policy=str(self.policy_path), telemetry=False,
            engine=tiny_engine(),
        )  # fmt: skip
        settings = ServerSettings(
            request_timeout_s=20, providers_file=str(self.providers_path), watch_interval_s=0.2
        )
        self.server = LiveServer(create_app(self.runner, settings=settings)).start()
        self.chat_url = f"{self.server.url}/v1/chat/completions"

    def post(self, turn_type: str, **body) -> httpx.Response:
        return httpx.post(
            self.chat_url,
            json={"messages": HI, "max_tokens": 4, **body},
            headers={"X-OpenAlice-Turn-Type": turn_type},
            timeout=30,
        )

    def close(self) -> None:
        self.server.stop()
        for s in (self.hang, self.dying, self.garbage, self.echo):
            s.stop()


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FAULT_KEY", PROVIDER_KEY)
    s = FaultStack(tmp_path_factory.mktemp("faults"))
    yield s
    s.close()
    mp.undo()


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert PROVIDER_KEY not in r.text
    return body["error"]


def _served_by_local_after(r: httpx.Response, failed: str) -> None:
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["provider"] == "local" and data["fallback_from"] == [failed]


def _stream_events(faults, turn_type: str) -> list[str]:
    with httpx.stream(
        "POST",
        faults.chat_url,
        json={"messages": HI, "max_tokens": 4, "stream": True},
        headers={"X-OpenAlice-Turn-Type": turn_type},
        timeout=30,
    ) as r:
        if r.status_code != 200:
            r.read()
            return [r.text]
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_refused_connections_fall_back_or_fail_cleanly(faults):
    _served_by_local_after(faults.post("refused_fb"), "dead")
    err = _error(faults.post("refused"), 503)
    assert err["code"] == "provider_unavailable"


def test_a_hanging_provider_times_out_then_falls_back_or_fails_cleanly(faults):
    t0 = time.monotonic()
    _served_by_local_after(faults.post("hang_fb"), "hang")
    assert time.monotonic() - t0 < 20  # generous: the CPU is shared
    t0 = time.monotonic()
    err = _error(faults.post("hang"), 504)
    assert err["code"] == "provider_timeout" and time.monotonic() - t0 < 20
    # The caller's own deadline is shorter than the provider's timeout: it wins.
    r = httpx.post(
        faults.chat_url, json={"messages": HI, "timeout": 0.2},
        headers={"X-OpenAlice-Turn-Type": "hang"}, timeout=30,
    )  # fmt: skip
    assert _error(r, 408)["code"] == "deadline_exceeded"


def test_garbage_answers_fall_back_or_fail_cleanly(faults):
    _served_by_local_after(faults.post("garbage_fb"), "garbage")
    r = faults.post("garbage")
    assert r.status_code in (502, 503), r.text
    _error(r, r.status_code)
    events = _stream_events(faults, "garbage")
    assert events and "error" in json.loads(events[-1])


def test_a_provider_dying_mid_stream_ends_the_stream_with_an_error_event(faults):
    events = _stream_events(faults, "dying")
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert any(c.get("choices") and c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["error"]["code"] == "stream_broken"  # no silent restart on another provider
    assert faults.post("chat").status_code == 200  # and the server serves on


def test_upstream_error_echoing_the_key_does_not_leak_it(faults):
    err = _error(faults.post("echo"), 401)
    assert "[REDACTED]" in err["message"]


def test_broken_policy_file_while_serving_keeps_the_last_good_one(faults):
    store = faults.runner.policy
    good = store.version
    text = faults.policy_path.read_text()
    try:
        faults.policy_path.write_text(text + "\nrules: [oops\n")
        store.reload_if_changed()
        assert store.version == good
        r = faults.post("chat")
        assert r.status_code == 200 and r.json()["speculation"]["policy_version"] == good
    finally:
        faults.policy_path.write_text(text)
        store.reload_if_changed()
    wait_for(lambda: store.version, lambda v: v == good)


def test_providers_file_broken_while_serving_keeps_the_last_good_one(faults):
    health_url = f"{faults.server.url}/health"
    good = faults.providers_path.read_text()

    def health():
        return httpx.get(health_url, timeout=10).json()["providers"]

    def max_queue():
        text = httpx.get(f"{faults.server.url}/metrics", timeout=10).text
        return metric_sample(text, "openalice_provider_max_queue", provider="local")

    try:
        faults.providers_path.write_text(good.replace("routes:", "routes: [oops"))
        broken = wait_for(health, lambda h: "last_error" in h)
        assert "providers.yaml:" in broken["last_error"]  # positioned, FILE:LINE:COL
        assert faults.post("chat").status_code == 200  # served on the last good config
        _served_by_local_after(faults.post("refused_fb"), "dead")

        # A valid edit applies live: admission limits and routes.
        edited = good.replace("max_tokens_default: 4}", "max_tokens_default: 4, max_queue: 3}")
        edited = edited.replace(
            "routes:\n", "routes:\n  - {name: extra, match: {turn_types: [extra]}, chain: [local]}\n"
        )
        faults.providers_path.write_text(edited)
        wait_for(health, lambda h: "last_error" not in h)
        wait_for(max_queue, lambda v: v == 3)
        assert faults.post("extra").status_code == 200

        # A changed provider definition is not swapped under running requests: a restart is asked for.
        faults.providers_path.write_text(
            edited.replace("tiny_random: true", "tiny_random: true, dtype: fp32")
        )
        assert wait_for(health, lambda h: "needs_restart" in h)["needs_restart"] == ["local"]
        assert faults.post("chat").status_code == 200
    finally:
        faults.providers_path.write_text(good)
    wait_for(health, lambda h: "last_error" not in h and "needs_restart" not in h)
    wait_for(max_queue, lambda v: v == 16)

"""Engine faults through the sidecar, over a real socket: the status each kind gets.

An input error the engine finds is a 400 naming its field; any other engine exception is a 500 whose
OpenAI-style body says it is an internal error (not the client's), or, where the route has another
provider, that provider serves (the fault came before the first token). After the first token a
fault ends the stream with an error event. The server serves on after each."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from locations import REPO
from stand_ins.engines import tiny_engine
from support.live_server import LiveServer

from openalice_runner.engine.errors import InvalidRequest
from openalice_runner.runner import Runner
from openalice_runner.server.app import ServerSettings, create_app
from tests.stand_ins.openai_server import OpenAIStandIn

HI = [{"role": "user", "content": "hi"}]


class Injected(RuntimeError):
    """A bug of ours, injected."""


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FAULTS_KEY", "sk-stand-in")
    tmp = tmp_path_factory.mktemp("faults-server")
    backup = OpenAIStandIn().start()
    (tmp / "providers.yaml").write_text(
        "providers:\n"
        "  local: {type: local, tiny_random: true, max_tokens_default: 8}\n"
        f"  backup: {{type: hosted, model: openai/stand-in, api_base: '{backup.url}', api_key_env: FAULTS_KEY,"
        " max_retries: 0}\n"
        "routes:\n"
        "  - {name: fb, match: {turn_types: [fb]}, chain: [local, backup]}\n"
        "  - {name: default, chain: [local]}\n"
    )
    shutil.copy(REPO / "policies" / "default.yaml", tmp / "policy.yaml")
    runner = Runner.from_config(providers=str(tmp / "providers.yaml"), policy=str(tmp / "policy.yaml"),
                                telemetry=False, engine=tiny_engine())  # fmt: skip
    server = LiveServer(create_app(runner, settings=ServerSettings(request_timeout_s=60))).start()
    yield f"{server.url}/v1/chat/completions"
    server.stop()
    backup.stop()
    mp.undo()


def _fault(monkeypatch, exc: BaseException, after_events: int = 0) -> None:
    engine = tiny_engine()
    real = engine.stream

    def stream(*args, **kwargs):
        events = real(*args, **kwargs)
        for i, event in enumerate(events):
            if i >= after_events:
                events.close()
                raise exc
            yield event

    monkeypatch.setattr(engine, "stream", stream)


def _post(url: str, turn_type: str = "chat", **body) -> httpx.Response:
    return httpx.post(url, json={"messages": HI, "max_tokens": 8, **body},
                      headers={"X-OpenAlice-Turn-Type": turn_type}, timeout=60)  # fmt: skip


def _stream(url: str, turn_type: str = "chat", **body) -> tuple[int, list[str]]:
    with httpx.stream("POST", url, json={"messages": HI, "max_tokens": 8, "stream": True, **body},
                      headers={"X-OpenAlice-Turn-Type": turn_type}, timeout=60) as r:  # fmt: skip
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.text]
        return 200, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _error(status: int, text: str) -> dict:
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, text
    return body["error"]


@pytest.mark.parametrize("streamed", [False, True])
def test_an_engine_fault_is_a_500_that_says_internal_error(monkeypatch, sidecar, streamed):
    _fault(monkeypatch, Injected("position 9999 is beyond the cache of 512"))
    if streamed:
        status, events = _stream(sidecar)
        text = events[0]
    else:
        r = _post(sidecar)
        status, text = r.status_code, r.text
    assert status == 500, text
    error = _error(status, text)
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "internal error" in error["message"] and "9999" not in error["message"]  # details stay in the log
    monkeypatch.undo()
    assert _post(sidecar).status_code == 200


def test_a_plain_valueerror_from_the_engine_is_ours_too(monkeypatch, sidecar):
    _fault(monkeypatch, ValueError("an option the engine does not support"))
    r = _post(sidecar)
    assert r.status_code == 500 and _error(500, r.text)["code"] == "internal_error"


@pytest.mark.parametrize("streamed", [False, True])
def test_an_engine_fault_before_the_first_token_falls_back(monkeypatch, sidecar, streamed):
    _fault(monkeypatch, Injected("a bug"))
    if streamed:
        status, events = _stream(sidecar, "fb")
        assert status == 200, events
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        assert chunks[-1].get("provider") == "backup" and chunks[-1].get("fallback_from") == ["local"]
    else:
        r = _post(sidecar, "fb")
        assert r.status_code == 200, r.text
        assert r.json()["provider"] == "backup" and r.json()["fallback_from"] == ["local"]


@pytest.mark.parametrize("streamed", [False, True])
def test_an_input_error_from_the_engine_is_a_400_naming_its_field(monkeypatch, sidecar, streamed):
    _fault(monkeypatch, InvalidRequest("top_k must be >= 0, got -1", param="top_k"))
    for turn_type in ("chat", "fb"):  # never retried elsewhere: resending it fails the same way
        if streamed:
            status, events = _stream(sidecar, turn_type)
            text = events[0]
        else:
            r = _post(sidecar, turn_type)
            status, text = r.status_code, r.text
        assert status == 400, text
        error = _error(status, text)
        assert error["type"] == "invalid_request_error" and error["param"] == "top_k"


def test_an_engine_fault_after_the_first_token_ends_the_stream_with_an_error_event(monkeypatch, sidecar):
    _fault(monkeypatch, Injected("mid-stream"), after_events=4)
    status, events = _stream(sidecar, "fb", max_tokens=16)
    assert status == 200
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert any(c.get("choices") and c["choices"][0]["delta"].get("content") for c in chunks), chunks
    assert chunks[-1]["error"]["code"] == "stream_broken"  # no silent restart on the backup
    monkeypatch.undo()
    assert _post(sidecar).status_code == 200

"""Issue 23's findings 2, 3 and 5: private files (prompt log, trace file), slow and too many
connections, and requests still running past --shutdown-grace. Real files, real sockets on loopback,
real `serve` processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import stat
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from locations import REPO
from stand_ins.engines import tiny_engine
from support.serve_process import TINY, Serve

from openalice_runner import Runner
from openalice_runner.private_file import PrivateFileError
from openalice_runner.prompt_log import MAX_ENTRY_BYTES, PromptLog
from openalice_runner.providers.base import CallContext
from openalice_runner.tracing.jsonl import JsonLinesSpanExporter
from openalice_runner.training.data import read_prompts
from openalice_runner.types import ChatRequest
from tests.stand_ins.serve import ServerThread

HI = [{"role": "user", "content": "hi"}]


# ---- 2: files that hold prompts


@pytest.mark.parametrize("make", [PromptLog, JsonLinesSpanExporter])
def test_private_files_refuse_a_symlink_and_force_owner_only(tmp_path, make):
    target = tmp_path / "elsewhere.txt"
    target.write_text("someone else's\n")
    link = tmp_path / "out.jsonl"
    link.symlink_to(target)
    with pytest.raises(PrivateFileError, match="symbolic link"):
        make(link)
    assert target.read_text() == "someone else's\n"  # nothing went through the link

    existing = tmp_path / "existing.jsonl"
    existing.write_text("")
    existing.chmod(0o644)
    make(existing)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600  # a wider mode is taken away

    fresh = tmp_path / "sub" / "fresh.jsonl"
    make(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("make", [PromptLog, JsonLinesSpanExporter])
def test_private_files_refuse_another_users_file(tmp_path, make):
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text("")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PrivateFileError, match="owned by uid 65534"):
        make(theirs)


def test_a_link_swapped_in_later_is_refused_and_the_request_goes_on(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    log = PromptLog(path)
    target = tmp_path / "target.txt"
    target.write_text("")
    path.unlink()
    path.symlink_to(target)
    log.record(ChatRequest(messages=HI), "chat")
    assert log.written == 0 and target.read_text() == "" and "symbolic link" in caplog.text


async def test_only_requests_that_were_answered_are_logged(tmp_path):
    path = tmp_path / "prompts.jsonl"
    runner = Runner.from_config(engine=tiny_engine(), telemetry=False, policy=False, prompt_log=path)
    await runner.chat(ChatRequest(messages=[{"role": "user", "content": "answered"}], max_tokens=2))
    with pytest.raises(Exception, match="(?i)context"):  # past the tiny model's context: refused
        await runner.chat(ChatRequest(messages=[{"role": "user", "content": "w " * 5000}], max_tokens=2))
    # a stream the client leaves after its first chunk, and one that ends whole
    left = ChatRequest(messages=[{"role": "user", "content": "left"}], max_tokens=8)
    async with runner.stream(left, CallContext()) as chunks:
        await chunks.__anext__()
    async with runner.stream(ChatRequest(messages=[{"role": "user", "content": "streamed"}], max_tokens=2)) as chunks:
        async for _ in chunks:
            pass
    # a request stopped by its deadline (the sidecar's 408) is cancelled the same way
    task = asyncio.ensure_future(
        runner.chat(ChatRequest(messages=[{"role": "user", "content": "cancelled"}], max_tokens=64))
    )
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    kept = [json.loads(line)["messages"][-1]["content"] for line in path.read_text().splitlines()]
    assert kept == ["answered", "streamed"]
    await runner.aclose()


def test_one_entry_is_capped_and_marked(tmp_path):
    path = tmp_path / "p.jsonl"
    log = PromptLog(path)
    huge = "é" * (4 * 1024 * 1024)  # 8 MB of UTF-8, as the probe sent
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    log.record(ChatRequest(messages=[{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": huge}], tools=tools), "chat")  # fmt: skip
    log.record(ChatRequest(messages=HI), "chat")
    raw = path.read_bytes().splitlines(keepends=True)
    assert len(raw) == 2 and len(raw[0]) <= MAX_ENTRY_BYTES
    first = json.loads(raw[0])
    assert first["truncated"]["original_bytes"] > 8 * 1024 * 1024
    assert first["messages"][0] == {"role": "system", "content": "be brief"}
    assert huge.startswith(first["messages"][1]["content"]) and len(first["messages"][1]["content"]) > 50_000
    assert first["tools"] == tools
    assert "truncated" not in json.loads(raw[1])
    assert len(read_prompts([path])) == 2  # draft train still reads both


def test_serve_refuses_a_symlinked_trace_file_or_prompt_log(tmp_path):
    import subprocess
    import sys

    target = tmp_path / "target"
    target.write_text("")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    (tmp_path / "providers.yaml").write_text(TINY + "routes:\n  - {name: default, chain: [local]}\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for flag in ("--trace-file", "--log-prompts"):
        out = subprocess.run(
            [sys.executable, "-m", "openalice_runner", "serve", "--port", "1", flag, str(link),
             "--providers", str(tmp_path / "providers.yaml")],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert "symbolic link" in out.stderr and str(link) in out.stderr and "Traceback" not in out.stderr


# ---- 3: slow request heads and too many connections


def _guarded_server(header_timeout: float, max_connections: int) -> ServerThread:
    """uvicorn as `serve` configures it (cli/serve.py uvicorn_config), around a small app."""
    import uvicorn

    from openalice_runner.cli.serve import uvicorn_config

    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    args = argparse.Namespace(
        host="127.0.0.1", port=0, shutdown_grace=1.0, header_timeout=header_timeout, max_connections=max_connections,
        reserved_connections=0, body_timeout=30.0, body_grace=5.0, min_body_rate=1024.0,
    )
    server = ServerThread(app)
    server.server = uvicorn.Server(uvicorn_config(app, args))
    server.server.config.lifespan = "off"
    server.thread = threading.Thread(target=server.server.run, daemon=True)
    return server.start()


def _read_until_closed(sock: socket.socket, limit_s: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (the limit only stops a hang)."""
    sock.settimeout(limit_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def test_a_slow_request_head_is_cut_off():
    server = _guarded_server(header_timeout=1.0, max_connections=64)
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHo")  # and then nothing more, as a slowloris does
        idle = socket.create_connection(("127.0.0.1", server.port))  # sends nothing at all
        answer = _read_until_closed(slow)
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"header_timeout"' in answer
        assert _read_until_closed(idle) == b""  # closed without an answer nobody asked for
        # a client that sends its head in time is served, and may send its next one on the same connection
        with httpx.Client(base_url=server.url) as client:
            assert client.get("/health").status_code == 200
            assert client.get("/health").status_code == 200
    finally:
        server.stop()


def test_connections_past_the_cap_are_refused_at_once():
    server = _guarded_server(header_timeout=60.0, max_connections=2)
    try:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        deadline = time.monotonic() + 10
        while len(server.server.server_state.connections) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        extra = socket.create_connection(("127.0.0.1", server.port))
        answer = _read_until_closed(extra)
        assert answer.startswith(b"HTTP/1.1 503 ") and b'"too_many_connections"' in answer
        for s in held:
            s.close()
        deadline = time.monotonic() + 10
        while server.server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # room again
    finally:
        server.stop()


# ---- 5: past --shutdown-grace


def _slow_upstream(seen: list[str]) -> FastAPI:
    """An OpenAI-protocol upstream that never finishes: a plain request waits forever, a stream
    sends one chunk and then waits forever."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append("stream" if body.get("stream") else "plain")
        if not body.get("stream"):
            await asyncio.sleep(3600)

        async def events():
            chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "slow",
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}]}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(3600)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_past_the_shutdown_grace_plain_gets_503_json_and_a_stream_an_error_event(tmp_path):
    seen: list[str] = []
    upstream = ServerThread(_slow_upstream(seen)).start()
    providers = (
        "providers:\n"
        f"  slow: {{type: hosted, model: openai/slow, api_base: '{upstream.url}/v1', api_key_env: SLOW_KEY,"
        " max_retries: 0, timeout_s: 600, first_token_timeout_s: 600}\n"
        "routes:\n  - {name: default, match: {models: ['*']}, chain: [slow]}\n"
    )
    serve = Serve(tmp_path, providers, "--shutdown-grace", "1", env={"SLOW_KEY": "sk-slow"})
    results: dict[str, object] = {}

    def plain():
        r = httpx.post(f"{serve.url}/v1/chat/completions", json={"messages": HI}, timeout=120)
        results["plain"] = (r.status_code, r.headers.get("content-type"), r.text)

    def stream():
        events = []
        with httpx.stream("POST", f"{serve.url}/v1/chat/completions", timeout=120,
                          json={"messages": HI, "stream": True}) as r:  # fmt: skip
            results["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    results["stream_started"] = True
        results["stream"] = events

    try:
        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 90
        while (sorted(seen) != ["plain", "stream"] or not results.get("stream_started")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(seen) == ["plain", "stream"] and results.get("stream_started"), serve.log()
        assert serve.terminate(timeout=60) == 0
        for t in threads:
            t.join(60)
    finally:
        if serve.proc.poll() is None:
            serve.terminate()
        upstream.stop()
    status, content_type, text = results["plain"]
    assert status == 503 and content_type == "application/json", text
    error = json.loads(text)["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable_error"
    assert results["stream_status"] == 200
    events = results["stream"]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hel"
    assert json.loads(events[-1])["error"]["code"] == "server_shutting_down"  # the stream says why it ends
    # the access log says what the client got: no 200 for the cut stream, no 500 for the plain one
    logged = [json.loads(line) for line in serve.log().splitlines() if line.startswith("{")]
    access = [a for a in logged if a.get("event") == "request" and a.get("path") == "/v1/chat/completions"]
    assert sorted(a["status"] for a in access) == [503, 503], access
    assert [a.get("status_sent") for a in access if a.get("cut")] == [200]

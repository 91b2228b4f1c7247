"""Issue 34, findings 4 and 7 (HTTP layer), over real sockets on loopback: a slow request body is
cut off (small limits, so it runs in seconds), /health and /metrics have a reserved slice of the
connection cap, what h11 cannot parse gets OpenAI's error shape, and after SIGTERM new requests
get 503 JSON with Retry-After until the socket closes."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from support.serve_process import TINY, Serve

from openalice_runner.cli.serve import uvicorn_config
from openalice_runner.server.connections import DrainingServer
from server.hardening.test_serve_process import _read_until_closed
from tests.stand_ins.serve import ServerThread


def _server(**limits) -> ServerThread:
    """uvicorn as `serve` configures it (cli/serve.py uvicorn_config), around a small app."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    args = argparse.Namespace(**{
        "host": "127.0.0.1", "port": 0, "shutdown_grace": 1.0, "header_timeout": 60.0, "max_connections": 64,
        "reserved_connections": 0, "body_timeout": 30.0, "body_grace": 5.0, "min_body_rate": 1024.0, **limits,
    })  # fmt: skip
    server = ServerThread(app)
    server.server = uvicorn.Server(uvicorn_config(app, args))
    server.server.config.lifespan = "off"
    server.thread = threading.Thread(target=server.server.run, daemon=True)
    return server.start()


def _head(length: int) -> bytes:
    return (f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _wait_connections(server: ServerThread, n: int, *, at_most: bool = False) -> None:
    """Until the server holds at least `n` open connections (`at_most`: no more than `n`)."""

    def done() -> bool:
        held = len(server.server.server_state.connections)
        return held <= n if at_most else held >= n

    deadline = time.monotonic() + 10
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done(), len(server.server.server_state.connections)


def test_a_body_that_stops_after_the_head_is_cut_off():
    server = _server(body_timeout=1.0, body_grace=0.5, min_body_rate=0.0)
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(_head(1000) + b"{")  # one byte of a thousand, then nothing
        answer = _read_until_closed(slow)
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in answer, answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "timeout_error"
        r = httpx.post(f"{server.url}/echo", content=b"x" * 5000, timeout=10)  # a whole body is served
        assert r.json() == {"bytes": 5000}
    finally:
        server.stop()


def test_a_body_trickling_below_the_minimum_rate_is_cut_off():
    server = _server(body_timeout=30.0, body_grace=0.5, min_body_rate=200.0)
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(_head(1000))
        cut = threading.Event()

        def trickle():  # one byte every 50 ms: 20 B/s, a tenth of the minimum
            try:
                while not cut.is_set():
                    slow.sendall(b" ")
                    time.sleep(0.05)
            except OSError:
                pass

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        answer = _read_until_closed(slow)  # long before the 30 s timeout (the read's limit also 30 s)
        cut.set()
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in answer, answer
    finally:
        server.stop()


def test_a_client_still_uploading_when_cut_off_reads_the_408_not_a_reset():
    """Cut with a 408 while it still sends its body, a client can go on writing and then read the
    answer and a clean end: the server half-closes and drops what still comes (a lingering close).
    Closed at once, the server's kernel answered the next write with a reset, which fails the
    client's later writes and can discard the 408 unread (seen in CI as ConnectionResetError)."""
    server = _server(body_timeout=1.0, body_grace=0.5, min_body_rate=0.0)
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(_head(100_000) + b"{")
        slow.settimeout(30)
        assert slow.recv(1, socket.MSG_PEEK) == b"H"  # the answer is in: the server has cut the request
        for _ in range(20):  # the client has not looked yet and goes on uploading
            slow.sendall(b" " * 1000)  # a reset answering the first raises here (EPIPE / ECONNRESET)
        answer = _read_until_closed(slow)  # the 408, then the end of the stream, not a reset
        assert answer.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in answer, answer
        slow.close()
        r = httpx.post(f"{server.url}/echo", content=b"x" * 5000, timeout=10)  # the server goes on serving
        assert r.json() == {"bytes": 5000}
    finally:
        server.stop()


def test_a_client_that_never_stops_sending_is_closed_after_the_linger():
    """The lingering close is bounded: a client that goes on sending after the 408 (and never reads
    or closes) is closed `linger_s` after the answer, and its connection slot is freed."""
    server = _server(body_timeout=1.0, body_grace=0.5, min_body_rate=0.0)
    try:
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(_head(100_000_000) + b"{")
        slow.settimeout(30)
        assert slow.recv(1, socket.MSG_PEEK) == b"H"
        reset = None
        try:
            while True:  # sends are read and dropped until the linger ends: then a reset stops them
                slow.sendall(b" " * 1000)
        except OSError as exc:
            reset = exc
        assert isinstance(reset, ConnectionResetError | BrokenPipeError), reset
        _wait_connections(server, 0, at_most=True)
    finally:
        slow.close()
        server.stop()


def test_health_is_answered_from_the_reserved_slice_when_clients_hold_every_connection():
    server = _server(max_connections=4, reserved_connections=2, body_timeout=60.0, min_body_rate=0.0)
    try:
        held = []
        for _ in range(4):  # every ordinary slot held by a body that never comes
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(_head(1000))
            held.append(s)
        _wait_connections(server, 4)
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.get("/health").status_code == 200  # the 5th connection: reserved, /health served
            refused = client.post("/echo", content=b"{}")  # another route on a reserved connection
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_connections"
            assert refused.headers["retry-after"] == "1"
        extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        _wait_connections(server, 6)
        past = socket.create_connection(("127.0.0.1", server.port))  # past the cap and the slice
        assert _read_until_closed(past).startswith(b"HTTP/1.1 503 ")
        for s in held + extra:
            s.close()
    finally:
        server.stop()


def test_a_malformed_content_length_gets_openais_error_shape():
    server = _server()
    try:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        answer = _read_until_closed(s)
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 400 ") and b"application/json" in head
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
        assert json.loads(body)["error"]["code"] == "invalid_http"
    finally:
        server.stop()


def test_serve_runs_the_draining_server():
    assert issubclass(DrainingServer, uvicorn.Server)


def test_after_sigterm_new_requests_get_503_json_with_retry_after_until_the_socket_closes(tmp_path):
    serve = Serve(tmp_path, TINY + "routes:\n  - {name: default, chain: [local]}\n", "--shutdown-grace", "30",
                  gated=True)
    answers: list[httpx.Response] = []
    serve.gate.touch()  # the stream's generation holds after its first pass until a new request is answered
    try:
        with httpx.stream(
            "POST", f"{serve.url}/v1/chat/completions", timeout=120,
            json={"messages": [{"role": "user", "content": "go on"}], "max_tokens": 200, "stream": True},
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            serve.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # the drain has begun once /health says so
                try:
                    if httpx.get(f"{serve.url}/health", timeout=1).status_code == 503:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
            try:  # a new connection, while the stream is still in flight (its generation holds)
                answers.append(httpx.post(f"{serve.url}/v1/chat/completions", timeout=10,
                                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}))
            except httpx.ConnectError:
                pass  # the socket closed first: the assertion below says so
            finally:
                serve.gate.unlink()
            rest = [line for line in lines if line.startswith("data: ")]
        assert serve.terminate() == 0
    finally:
        if serve.proc.poll() is None:
            serve.terminate()
    assert answers and answers[0].status_code == 503, "a new request during the drain was not answered 503: " + serve.log()[-2000:]
    error = answers[0].json()["error"]
    assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable_error"
    assert answers[0].headers["retry-after"] == "1"
    assert rest[-1] == "data: [DONE]"  # the stream in flight still finished whole

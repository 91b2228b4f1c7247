"""Run an ASGI app with uvicorn on 127.0.0.1 in a background thread (a real socket, a real server)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class ServerThread:
    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.host = host

    def start(self, timeout: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.01)
        self._port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def port(self) -> int:
        return self._port  # kept after stop(): a stopped server's URL then refuses connections

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def refused_url() -> str:
    """A loopback URL nothing listens on: connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"

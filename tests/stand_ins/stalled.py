"""A hung server: a loopback socket that accepts connections, reads what is sent, and never answers
(as a server whose engine stalled while its listener still accepts). What each connection sent
first is kept, so a test can wait for the request it expects to have arrived."""

from __future__ import annotations

import contextlib
import socket
import threading


class StalledServer:
    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.received: list[str] = []  # each connection's first line ("POST /v1/chat/completions HTTP/1.1")
        self._conns: list[socket.socket] = []
        self._changed = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]

    def start(self) -> StalledServer:
        self._threads[0].start()
        return self

    def _accept(self) -> None:
        while True:
            conn, _ = self._sock.accept()
            if self._stopping:
                conn.close()
                return
            with self._changed:
                self._conns.append(conn)
            reader = threading.Thread(target=self._read, args=(conn,), daemon=True)
            self._threads.append(reader)
            reader.start()

    def _read(self, conn: socket.socket) -> None:
        data = b""
        try:
            while b"\r\n" not in data:
                piece = conn.recv(65536)
                if not piece:
                    return
                data += piece
        except OSError:
            return
        with self._changed:
            self.received.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
            self._changed.notify_all()
        # and nothing is ever sent back: the connection stays open until the client gives up

    def chat_requests(self) -> int:
        with self._changed:
            return sum(line.startswith("POST /v1/chat/completions") for line in self.received)

    def wait_chat_requests(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until `n` chat requests have arrived (they may trail the client's own view)."""
        with self._changed:
            return self._changed.wait_for(
                lambda: sum(line.startswith("POST /v1/chat/completions") for line in self.received) >= n, timeout
            )

    def stop(self) -> None:
        """Stop listening and drop every held connection; the port is free for another server."""
        self._stopping = True
        with socket.create_connection(("127.0.0.1", self.port)):  # wakes the accept loop
            pass
        self._threads[0].join(10)
        self._sock.close()
        with self._changed:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # wakes a reader still in recv
                conn.close()

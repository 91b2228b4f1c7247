"""Grammars not yet known good are compiled first in a child process, so that no schema can take
the server down.

llguidance compiles a grammar in native code: a schema past its limits can crash it (a chain of
a thousand `$ref`s overflowed its stack: SIGSEGV, every request in flight lost) or run for
seconds where no thread can stop it. A child (`python -m openalice_runner.engine.grammar_check`,
llguidance and numpy only, the model's tokenizer sent at start) builds the matcher for each text
the server has not compiled before, in a thread with a quarter of the stack the server's own
compile threads have (grammar.py), and says whether it compiled. A child that times out is
killed (the compile is cancelled); one that dies is replaced, and the text tried once more on the
fresh one: a crash that repeats is the schema's (400), one that does not was not.

Messages on the pipes: a 4-byte big-endian length, then the bytes (JSON, or a grammar's text).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from openalice_runner.engine.grammar_build import GrammarError, GrammarFault, build_matcher, llg_tokenizer

CHECK_STACK = 8 << 20  # the child's compile thread; the server compiles with 4x this (grammar.py)
START_TIMEOUT_S = 120.0  # building the tokenizer's tables takes 1-2 s; a loaded machine, more
_HEADER = struct.Struct(">I")


class _Died(Exception):
    def __init__(self, returncode: int | None) -> None:
        super().__init__(returncode)
        self.returncode = returncode


class _TimedOut(Exception):
    pass


def _how(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class GrammarChecker:
    """Up to `processes` children, each used by one compile at a time (the caller passes the one it
    holds: grammar.py's compile threads take one each)."""

    def __init__(self, tokenizer_text: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._init = json.dumps({"tokenizer": tokenizer_text, "vocab_size": vocab_size,
                                 "eos_ids": list(eos_ids)}).encode()  # fmt: skip

    def child(self) -> _Child:
        return _Child(self._init)

    def check(self, child: _Child, text: str, timeout_s: float) -> None:
        """None where `text` compiles; GrammarError where it does not (code "grammar_timeout" where
        it took longer than `timeout_s`, counted from when the child has it); GrammarFault where
        no child could be started or one failed in a way that is ours."""
        try:
            reply = child.ask(text, timeout_s)
        except _Died as died:
            try:  # once more on a fresh process: a fault of the old one's state is not the schema's
                reply = child.ask(text, timeout_s)
            except _Died as again:
                how = _how(again.returncode)
                twice = "twice" if again.returncode == died.returncode else f"after {_how(died.returncode)}"
                raise GrammarError(f"the grammar backend crashed compiling the schema ({how}, {twice}, each time in "
                                   "a fresh process): the schema is past what it can compile") from None
        if "error" in reply:
            raise GrammarError(reply["error"], code=reply.get("code") or "invalid_value")
        if "fault" in reply:
            raise GrammarFault(f"the grammar checker failed: {reply['fault']}")


class _Child:
    """One child process, started on first use and again after it died or was killed."""

    def __init__(self, init: bytes) -> None:
        self._init = init
        self.proc: subprocess.Popen | None = None

    def ask(self, text: str, timeout_s: float) -> dict[str, Any]:
        if self.proc is None:
            self._start()
        deadline = time.monotonic() + timeout_s
        try:
            self._write(text.encode(), deadline)
            return json.loads(self._receive(deadline))
        except _TimedOut:
            self.stop()  # the compile is cancelled with its process
            raise GrammarError(
                f"compiling the schema's grammar took longer than {timeout_s:g} s (the server's --grammar-timeout)",
                code="grammar_timeout",
            ) from None

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # this very package, whatever sys.path says
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                          if p)}  # fmt: skip
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            [sys.executable, "-m", "openalice_runner.engine.grammar_check"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )  # fmt: skip
        os.set_blocking(self.proc.stdin.fileno(), False)  # writes wait with a deadline (_write)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            self._write(self._init, deadline)
            ready = json.loads(self._receive(deadline))
        except (_Died, _TimedOut) as exc:
            how = _how(exc.returncode) if isinstance(exc, _Died) else type(exc).__name__
            self.stop()
            raise GrammarFault(f"the grammar checker process did not start ({how})") from None
        if ready != {"ready": True}:  # pragma: no cover - the child sends nothing else first
            self.stop()
            raise GrammarFault(f"the grammar checker process did not start: {ready}")

    def _write(self, data: bytes, deadline: float) -> None:
        """One message to the child, within `deadline` (a child that stopped reading is not waited
        for without bound); _Died where it is gone."""
        fd = self.proc.stdin.fileno()
        view = memoryview(_HEADER.pack(len(data)) + data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise _TimedOut()
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except OSError:  # a broken pipe: it died
                raise _Died(self._reap()) from None

    def _receive(self, deadline: float) -> bytes:
        head = self._read(_HEADER.size, deadline)
        return self._read(_HEADER.unpack(head)[0], deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        out = bytearray()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _TimedOut()
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise _Died(self._reap())
            out += chunk
        return bytes(out)

    def _reap(self) -> int | None:
        proc, self.proc = self.proc, None
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - it closed its pipe but lives on
            proc.kill()
            return proc.wait()
        finally:
            _close_pipes(proc)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            _close_pipes(proc)


def _close_pipes(proc: subprocess.Popen) -> None:
    for pipe in (proc.stdin, proc.stdout):
        with contextlib.suppress(OSError):
            pipe.close()


# ---------------------------------------------------------------- the child


def _send(pipe: BinaryIO, data: bytes) -> None:
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


def _read_message(pipe: BinaryIO) -> bytes | None:
    head = pipe.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None  # the server closed the pipe (it exited): so does the child
    return pipe.read(_HEADER.unpack(head)[0])


def _serve(requests: BinaryIO, replies: BinaryIO, tokenizer: Any, vocab_size: int) -> None:
    while (message := _read_message(requests)) is not None:
        try:
            build_matcher(message.decode(), tokenizer, vocab_size)
            reply: dict[str, Any] = {"ok": True}
        except GrammarError as exc:
            reply = {"error": str(exc), "code": exc.code}
        except Exception as exc:  # noqa: BLE001 - a fault of the checker is answered, not hidden
            reply = {"fault": f"{type(exc).__name__}: {exc}"}
        _send(replies, json.dumps(reply).encode())


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is the server's: it exits on EOF
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the replies
    init = json.loads(_read_message(requests) or b"null")
    tokenizer = llg_tokenizer(init["tokenizer"], init["vocab_size"], tuple(init["eos_ids"]))
    _send(replies, b'{"ready": true}')
    threading.stack_size(CHECK_STACK)
    worker = threading.Thread(target=_serve, args=(requests, replies, tokenizer, init["vocab_size"]))
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()

"""A file the server watches while serving (providers, keys): an edit that validates is applied live;
one that does not changes nothing: the last good one stays in force, and the problems (each
FILE:LINE:COL) go to the log and to /health until the file is fixed.

The file is polled (mtime and size as the hint, its content hash as the truth), read and parsed in a
worker thread (the YAML loader's limits bound what that costs: config_files/yaml_nodes.py), so a
hostile or huge edit never stalls the event loop; only applying a validated result runs on the loop,
as requests read it there. A subclass says what the file is (`what`), how it is read (`_read`), parsed
and checked (`_load`: raise to refuse) and applied (`_use`: raise to refuse).
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import structlog

from openalice_runner.config_files.reading import read_operator_file

log = structlog.get_logger("openalice_runner.server")


class WatchedFile:
    what = "file"  # in log lines: "<what> rejected; ..."

    def __init__(self, path: str | Path, interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self.last_error: str | None = None
        self._stamp = self._stat()
        self._digest = self._hash()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _hash(self) -> str | None:
        try:
            return hashlib.sha256(self._read()).hexdigest()
        except OSError:
            return None

    def _read(self) -> bytes:
        # Non-blocking, a regular file on the open descriptor, at most the loader's limit: a FIFO,
        # a device or a huge file swapped in is a problem here, never a stuck or endless read.
        return read_operator_file(self.path)

    def check(self) -> bool:
        """Reload if the file changed; True when a new version was applied."""
        return self._apply(self._parse())

    _UNCHANGED = object()

    def _parse(self) -> Any:
        """The edited file's content as `_load` makes it; _UNCHANGED, or None when it was rejected.
        Runs in a thread."""
        stamp = self._stat()
        if stamp == self._stamp:
            return self._UNCHANGED
        self._stamp = stamp
        try:
            data = self._read()
        except OSError as exc:
            self._digest = None  # the last good file put back is applied again (and clears the error)
            return self._reject(f"{self.path}:1:1: cannot read: {exc}")
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._digest:
            return self._UNCHANGED
        self._digest = digest
        try:
            return self._load(data)
        except UnicodeDecodeError as exc:
            return self._reject(f"{self.path}:1:1: not UTF-8 text ({exc.reason} at byte {exc.start})")
        except Exception as exc:  # a ConfigError names each problem; anything else is as bad
            return self._reject(str(exc))

    def _load(self, data: bytes) -> Any:
        raise NotImplementedError

    def _use(self, loaded: Any) -> None:
        raise NotImplementedError

    def _reject(self, problems: str) -> None:
        self.last_error = problems
        log.error(f"{self.what} rejected; the last good one stays in force", source=str(self.path),
                  problems=problems)  # fmt: skip
        return None

    def _apply(self, loaded: Any) -> bool:
        if loaded is None or loaded is self._UNCHANGED:
            return False
        try:
            self._use(loaded)
        except Exception as exc:  # e.g. a new provider that cannot be built (missing key)
            self.last_error = f"{self.path}: cannot apply: {exc}"
            log.error(f"{self.what} not applied; the last good one stays in force", error=str(exc))
            return False
        self.last_error = None
        log.info(f"{self.what} reloaded", source=str(self.path), **self._applied())
        return True

    def _applied(self) -> dict[str, Any]:
        """More to say in the "reloaded" log line."""
        return {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self._apply(await asyncio.to_thread(self._parse))
            except Exception as exc:  # the watcher must outlive anything a file can do to it
                log.error(f"{self.what} watch failed", error_type=type(exc).__name__)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": str(self.path)}
        if self.last_error:
            out["last_error"] = self.last_error
        return out

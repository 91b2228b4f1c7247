"""Watches the providers (routing) file while serving, as the policy store watches the policy.

An edit that validates is applied live (routes, admission limits, new providers: Runner.apply_routing);
a provider whose definition changed keeps its old one until a restart, and /health says so. An edit
that does not validate changes nothing: the last good config stays in force, the problems (each
FILE:LINE:COL) go to the log and to /health until the file is fixed.

The file is read and parsed in a worker thread (the YAML loader's limits bound what that costs:
config_files/yaml_nodes.py), so a hostile or huge edit never stalls the event loop; only applying
a validated config runs on the loop, as requests read it there.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from openalice_runner.config_files.reading import read_operator_file
from openalice_runner.server.runner_protocol import policy_store

if TYPE_CHECKING:
    from openalice_runner.server.runner_protocol import ServedRunner

log = structlog.get_logger("openalice_runner.server")


class RoutingWatcher:
    def __init__(self, runner: ServedRunner, path: str | Path, interval_s: float = 1.0) -> None:
        self.runner = runner
        self.path = Path(path)
        self.interval_s = interval_s
        self.last_error: str | None = None
        self.needs_restart: list[str] = []
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
            return hashlib.sha256(read_operator_file(self.path)).hexdigest()
        except OSError:
            return None

    def check(self) -> bool:
        """Reload if the file changed; True when a new config was applied."""
        return self._apply(self._parse())

    _UNCHANGED = object()

    def _parse(self) -> Any:
        """The edited file's config; _UNCHANGED, or None when it was rejected. Runs in a thread."""
        stamp = self._stat()
        if stamp == self._stamp:
            return self._UNCHANGED
        self._stamp = stamp
        try:
            # Non-blocking, a regular file on the open descriptor, at most the loader's limit: a FIFO,
            # a device or a huge file swapped in is a problem here, never a stuck or endless read.
            data = read_operator_file(self.path)
        except OSError as exc:
            self._digest = None  # the last good file put back is applied again (and clears the error)
            return self._reject(f"{self.path}:1:1: cannot read: {exc}")
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._digest:
            return self._UNCHANGED
        self._digest = digest
        from openalice_runner.providers.config import load_routing_text

        try:
            routing = load_routing_text(data.decode("utf-8"), str(self.path))
            self._check_pools()
        except UnicodeDecodeError as exc:
            return self._reject(f"{self.path}:1:1: not UTF-8 text ({exc.reason} at byte {exc.start})")
        except Exception as exc:  # RoutingConfigError names each problem; anything else is as bad
            return self._reject(str(exc))
        return routing

    def _reject(self, problems: str) -> None:
        self.last_error = problems
        log.error("providers file rejected; the last good one stays in force", source=str(self.path),
                  problems=problems)  # fmt: skip
        return None

    def _apply(self, routing: Any) -> bool:
        if routing is None or routing is self._UNCHANGED:
            return False
        try:
            self.needs_restart = self.runner.apply_routing(routing)
        except Exception as exc:  # e.g. a new provider that cannot be built (missing key)
            self.last_error = f"{self.path}: cannot apply: {exc}"
            log.error("providers file not applied; the last good one stays in force", error=str(exc))
            return False
        self.last_error = None
        log.info("providers file reloaded", source=str(self.path), needs_restart=self.needs_restart)
        return True

    def _check_pools(self) -> None:
        """The served policy's rules against the edited file's SGLang pools, as at load (ConfigError)."""
        store = policy_store(self.runner)
        policy_path = store.path if store is not None else None
        if policy_path is None:
            return  # no policy file (switched off, or given as an object)
        from openalice_runner.config_files import ConfigError
        from openalice_runner.providers.pools.pool_checks import check_pool_files

        problems = check_pool_files(policy_path, self.path)
        if problems:
            raise ConfigError(problems)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self._apply(await asyncio.to_thread(self._parse))
            except Exception as exc:  # the watcher must outlive anything a file can do to it
                log.error("providers watch failed", error_type=type(exc).__name__)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": str(self.path)}
        if self.last_error:
            out["last_error"] = self.last_error
        if self.needs_restart:
            out["needs_restart"] = self.needs_restart
        return out

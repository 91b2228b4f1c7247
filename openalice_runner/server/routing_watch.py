"""Watches the providers (routing) file while serving, as the policy store watches the policy.

An edit that validates is applied live (routes, admission limits, new providers: Runner.apply_routing);
a provider whose definition changed keeps its old one until a restart, and /health says so. An edit
that does not validate changes nothing: the last good config stays in force, the problems (each
FILE:LINE:COL) go to the log and to /health until the file is fixed (server/file_watch.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from openalice_runner.server.file_watch import WatchedFile
from openalice_runner.server.runner_protocol import policy_store

if TYPE_CHECKING:
    from openalice_runner.server.runner_protocol import ServedRunner


class RoutingWatcher(WatchedFile):
    what = "providers file"

    def __init__(self, runner: ServedRunner, path: str | Path, interval_s: float = 1.0) -> None:
        self.runner = runner
        self.needs_restart: list[str] = []
        super().__init__(path, interval_s)

    def _load(self, data: bytes) -> Any:
        from openalice_runner.providers.config import load_routing_text

        routing = load_routing_text(data.decode("utf-8"), str(self.path))
        self._check_pools()
        return routing

    def _use(self, routing: Any) -> None:
        self.needs_restart = self.runner.apply_routing(routing)

    def _applied(self) -> dict[str, Any]:
        return {"needs_restart": self.needs_restart}

    def _check_pools(self) -> None:
        """The served policy's rules against the edited file's SGLang pools, as at load (ConfigError)."""
        store = policy_store(self.runner)
        policy_path = store.path if store is not None else None
        if policy_path is None:
            return  # no policy file (switched off, or given as an object)
        from openalice_runner.config_files import ConfigError
        from openalice_runner.pool_checks import check_pool_files

        problems = check_pool_files(policy_path, self.path)
        if problems:
            raise ConfigError(problems)

    def status(self) -> dict[str, Any]:
        out = super().status()
        if self.needs_restart:
            out["needs_restart"] = self.needs_restart
        return out

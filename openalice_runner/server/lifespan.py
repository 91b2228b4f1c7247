"""What the sidecar does around serving: before the first request and after the last.

Startup: the policy file's watcher, the embedded models loaded (the first request should not pay for
that), the idle-turn reaper and the providers and keys files' watchers. Shutdown, in reverse: open turns closed,
watchers stopped, the runner closed, then `on_shutdown` (the CLI flushes the trace exporters there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from openalice_runner.server.file_watch import WatchedFile
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.routing_watch import RoutingWatcher
from openalice_runner.server.runner_protocol import ServedRunner, policy_store
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.turns import TurnTracker


class ServingLifespan:
    """`run` is the app's lifespan."""

    def __init__(
        self,
        runner: ServedRunner,
        *,
        settings: ServerSettings,
        tracker: TurnTracker,
        metrics: ServerMetrics,
        routing_watch: RoutingWatcher | None,
        on_shutdown: Callable[[], Any] | None,
        keys_watch: WatchedFile | None = None,
    ) -> None:
        self.runner = runner
        self.settings = settings
        self.tracker = tracker
        self.metrics = metrics
        self.routing_watch = routing_watch
        self.on_shutdown = on_shutdown
        self.keys_watch = keys_watch

    @asynccontextmanager
    async def run(self, _app: FastAPI) -> AsyncIterator[None]:
        policy = policy_store(self.runner) if self.settings.watch_policy else None  # a file to watch
        if policy is not None:
            policy.start_watching()
        for provider in self.runner.providers.values():
            await provider.ensure_loaded()
        reaper = asyncio.create_task(_reap_idle_turns(self.tracker, self.metrics))
        watchers = [asyncio.create_task(w.run()) for w in (self.routing_watch, self.keys_watch) if w is not None]
        try:
            yield
        finally:
            reaper.cancel()
            for watcher in watchers:
                watcher.cancel()
            self.tracker.close_all("shutdown")
            if policy is not None:
                policy.stop_watching()
            await self.runner.aclose()
            if self.on_shutdown is not None:
                self.on_shutdown()


async def _reap_idle_turns(tracker: TurnTracker, metrics: ServerMetrics) -> None:
    interval = max(1.0, min(30.0, tracker.idle_timeout_s / 4))
    while True:
        await asyncio.sleep(interval)
        tracker.reap_idle()
        metrics.open_turns.set(len(tracker))

"""The sidecar's read-only endpoints: GET /v1/models, /v1/models/{id}, /v1/policy, /health, /metrics.

Nothing here changes state; each answers from the runner, the turn tracker, the metrics and the watched
files as they are now. The request path is server/pipeline.py.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from openalice_runner.server.errors import APIError
from openalice_runner.server.file_watch import WatchedFile
from openalice_runner.server.health import authenticated, file_status
from openalice_runner.server.metrics import ServerMetrics
from openalice_runner.server.routing_watch import RoutingWatcher
from openalice_runner.server.runner_protocol import ServedRunner, policy_store
from openalice_runner.server.settings import ServerSettings
from openalice_runner.server.turns import TurnTracker


class ReadOnlyEndpoints:
    def __init__(
        self,
        runner: ServedRunner,
        *,
        settings: ServerSettings,
        tracker: TurnTracker,
        metrics: ServerMetrics,
        routing_watch: RoutingWatcher | None,
        keys_watch: WatchedFile | None = None,
    ) -> None:
        self.runner = runner
        self.settings = settings
        self.tracker = tracker
        self.metrics = metrics
        self.routing_watch = routing_watch  # None: no providers file is watched
        self.keys_watch = keys_watch  # None: no keys file (`serve --keys`)

    def add_to(self, app: FastAPI) -> None:
        app.get("/v1/models")(self.list_models)
        app.get("/v1/models/{model_id:path}")(self.retrieve_model)
        app.get("/v1/policy")(self.policy_in_force)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus_metrics)

    async def list_models(self) -> dict[str, Any]:
        created = int(time.time())
        names = self.runner.model_names()
        return {"object": "list", "data": [_model_object(name, created) for name in names]}

    async def retrieve_model(self, model_id: str) -> dict[str, Any]:
        if model_id not in self.runner.model_names():
            raise APIError(
                404, f"model {model_id!r} is not served here (GET /v1/models lists the models)",
                param="model", code="model_not_found", type="invalid_request_error",
            )  # fmt: skip
        return _model_object(model_id, int(time.time()))

    async def policy_in_force(self) -> dict[str, Any]:
        if self.runner.policy is None:
            raise APIError(404, "no policy is configured", code="no_policy")
        store = policy_store(self.runner)
        if store is None:  # a policy of another kind: there is no version, file or rules to show
            return {"version": None, "source": "", "policy": None}
        view: dict[str, Any] = {
            "version": store.version,
            "source": str(store.path or ""),
            "policy": store.policy.model_dump(mode="json"),
        }
        if store.last_error is not None:  # a broken edit keeps the last good policy in force; say so
            view["last_error"] = str(store.last_error)
        return view

    async def health(self, request: Request) -> dict[str, Any]:
        store = policy_store(self.runner)
        # With a keys file every key is a tenant's, a client's: the files' paths and problems stay in the log.
        full = self.keys_watch is None and authenticated(request.headers.get("authorization"), self.settings.api_key)
        out: dict[str, Any] = {
            "status": "ok",
            "models": self.runner.model_names(),
            "policy_version": store.version if store is not None else None,
            "open_turns": len(self.tracker),
        }
        if store is not None and store.path is not None:  # a rejected edit shows here, as in "providers"
            out["policy"] = file_status(store.path, store.last_error, full=full)
        if self.routing_watch is not None:
            watched = self.routing_watch.status()
            out["providers"] = file_status(watched["source"], watched.get("last_error"), full=full,
                                           needs_restart=watched.get("needs_restart"))  # fmt: skip
        if self.keys_watch is not None:
            out["keys"] = file_status(self.keys_watch.path, self.keys_watch.last_error, full=False)
        return out

    async def prometheus_metrics(self) -> Response:
        # Rendering walks every series: off the event loop, so a scrape never stalls requests.
        text = await anyio.to_thread.run_sync(self.metrics.scrape, self.settings.metrics_max_age_s)
        return Response(text, media_type=CONTENT_TYPE_LATEST)


def _model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "openalice-runner"}

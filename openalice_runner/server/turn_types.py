"""The turn types a client may send that become metric labels: those the policy's rules and the routes
name (tracing/labels.py bounds every other value to "other")."""

from __future__ import annotations

from typing import Any

from openalice_runner.server.runner_protocol import ServedRunner, policy_store


class ConfiguredTurnTypes:
    """Called for the current names; recomputed only when the policy's version or the routing changes."""

    def __init__(self, runner: ServedRunner) -> None:
        self.runner = runner
        self._key: tuple[Any, int] | None = None
        self._names: frozenset[str] = frozenset()

    def __call__(self) -> frozenset[str]:
        store, routing = policy_store(self.runner), self.runner.routing
        key = (store.version if store is not None else None, id(routing))
        if key != self._key:
            names: set[str] = set()
            for rule in store.policy.rules if store is not None else ():
                value = rule.match.turn_type
                names.update([value] if isinstance(value, str) else value or ())
            for route in routing.routes:
                names.update(route.match.turn_types or ())
            self._key, self._names = key, frozenset(names)
        return self._names

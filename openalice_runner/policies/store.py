"""PolicyStore: the live policy of a process (library or sidecar), with hot reload.

* `decide` reads one reference (the compiled policy) and never takes a lock or raises: if anything
  goes wrong inside, it answers `off` with the reason, so a request is never failed by the policy.
* A changed file is fully validated first, then swapped in with one assignment (atomic in CPython);
  a broken file is reported through `last_error` and the log, and the last good policy stays.
* Adaptive γ learns per tenant (`serve --keys`): one tenant's traffic must neither move γ for another
  nor let it read, from the γ its own replies run at, what the other's text accepted. The estimates
  of at most MAX_TENANTS tenants are kept (the oldest made goes first); requests without a tenant
  share `adaptive`.
* The watcher polls mtime and size each `interval` seconds and reloads when the content hash changes
  (polling works everywhere, needs no inotify, and an editor's rename-into-place is seen too).
  It runs in its own thread, never on an event loop; the YAML loader's limits (size, depth,
  aliases and what they expand to: config_files/yaml_nodes.py) bound what one parse can cost, so a
  hostile edit fails fast and the next valid edit applies at the next poll.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import cast

from openalice_runner.config_files.errors import Problem
from openalice_runner.config_files.reading import read_operator_file
from openalice_runner.policies.adaptive import AdaptiveGamma
from openalice_runner.policies.errors import PolicyError
from openalice_runner.policies.loader import content_version, load_policy_bytes, load_policy_text
from openalice_runner.policies.plan import CompiledPolicy, RequestContext
from openalice_runner.policies.schema import Policy
from openalice_runner.speculation import SpeculationOutcome, SpeculationPlan

log = logging.getLogger(__name__)

MAX_TENANTS = 256  # tenants whose adaptive-γ estimates are kept


class PolicyStore:
    def __init__(self, compiled: CompiledPolicy, path: Path | None = None, *, poll_interval: float = 1.0):
        self._compiled = compiled
        self.path = path
        self.poll_interval = poll_interval
        self.adaptive = AdaptiveGamma(compiled.policy.adaptive)  # requests without a tenant
        self._tenant_adaptive: dict[str, AdaptiveGamma] = {}  # replaced, never mutated: read without a lock
        self._tenants_lock = threading.Lock()
        self.last_error: PolicyError | None = None
        self._stat: tuple[int, int] | None = None
        self._reload_lock = threading.Lock()  # one reload at a time; decisions never take it
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # ---- construction ----
    @classmethod
    def from_file(
        cls, path: str | os.PathLike, *, watch: bool = False, poll_interval: float = 1.0
    ) -> PolicyStore:
        """Load and validate `path` (raises PolicyError listing FILE:LINE:COL problems)."""
        path = Path(path)
        data, stat = _read(path)
        loaded = load_policy_bytes(data, str(path))
        store = cls(CompiledPolicy(loaded.policy, loaded.version), path, poll_interval=poll_interval)
        store._stat = stat
        if watch:
            store.start_watching()
        return store

    @classmethod
    def from_text(cls, text: str, source: str = "<policy>") -> PolicyStore:
        loaded = load_policy_text(text, source)
        return cls(CompiledPolicy(loaded.policy, loaded.version))

    # ---- reads ----
    @property
    def version(self) -> str:
        return self._compiled.version

    @property
    def policy(self) -> Policy:
        return self._compiled.policy

    @property
    def compiled(self) -> CompiledPolicy:
        return self._compiled

    def adaptive_for(self, tenant: str | None) -> AdaptiveGamma:
        """The adaptive-γ estimates of `tenant` (made on first use); `adaptive` without a tenant."""
        if tenant is None:
            return self.adaptive
        found = self._tenant_adaptive.get(tenant)
        if found is not None:
            return found
        with self._tenants_lock:
            table = self._tenant_adaptive
            found = table.get(tenant)
            if found is None:
                found = AdaptiveGamma(self._compiled.policy.adaptive)
                table = {**table, tenant: found}
                while len(table) > MAX_TENANTS:
                    del table[next(iter(table))]
                self._tenant_adaptive = table
            return found

    def decide(self, ctx: RequestContext) -> SpeculationPlan:
        compiled = self._compiled  # one read: a concurrent reload cannot mix two policies
        try:
            return compiled.decide(ctx, self.adaptive_for(ctx.tenant))
        except Exception as exc:  # never fail a request because of the policy
            log.exception("policy decision failed; speculating off")
            return SpeculationPlan("off", 0, "error", f"policy error: {exc!r}", compiled.version)

    def observe(
        self, turn_type: str, method: str, provider: str | None, outcome: SpeculationOutcome,
        tenant: str | None = None,
    ) -> None:
        """Feed a finished request's outcome into its tenant's adaptive-γ estimates. Never raises."""
        try:
            self.adaptive_for(tenant).observe(turn_type, method, provider, outcome)
        except Exception:
            log.exception("policy observe failed; estimate not updated")

    # ---- reload ----
    def reload_if_changed(self) -> bool:
        """Reload when the file's content changed. True if a new policy is now in force.

        A broken or unreadable file leaves the current policy in force and sets `last_error`.
        """
        if self.path is None:
            return False
        with self._reload_lock:
            try:
                data, stat = _read(self.path)
            except PolicyError as exc:
                self._fail(exc)
                return False
            self._stat = stat
            version = content_version(data)
            if version == self._compiled.version:
                self.last_error = None  # e.g. a broken edit was reverted
                return False
            try:
                loaded = load_policy_bytes(data, str(self.path))
                compiled = CompiledPolicy(loaded.policy, loaded.version)
            except PolicyError as exc:
                self._fail(exc)
                return False
            except Exception as exc:  # a bug in the loader must not stop the watcher either
                self._fail(PolicyError([]), exc)
                return False
            for adaptive in (self.adaptive, *self._tenant_adaptive.values()):
                adaptive.configure(compiled.policy.adaptive)
            self._compiled = compiled
            self.last_error = None
            log.info("policy %s reloaded: version %s", self.path, compiled.version)
            return True

    def _fail(self, exc: PolicyError, cause: Exception | None = None) -> None:
        if cause is not None:
            log.error("policy %s reload failed (%r); keeping version %s", self.path, cause, self.version)
        elif str(exc) != str(self.last_error):  # say it once per distinct problem, not every poll
            log.error("policy %s is invalid; keeping version %s:\n%s", self.path, self.version, exc)
        self.last_error = exc

    # ---- watcher ----
    def start_watching(self, interval: float | None = None) -> None:
        if self.path is None:
            raise ValueError("this PolicyStore has no file to watch")
        if interval is not None:
            self.poll_interval = interval
        if self._watcher is not None and self._watcher.is_alive():
            return
        self._stop.clear()
        self._watcher = threading.Thread(
            target=self._watch, name=f"policy-watch:{self.path.name}", daemon=True
        )
        self._watcher.start()

    def stop_watching(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None

    @property
    def watching(self) -> bool:
        return self._watcher is not None and self._watcher.is_alive()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                # start_watching refuses a store without a file
                stat = _stat(cast(Path, self.path))
                # mtime+size is a cheap hint; the content hash in reload_if_changed is the truth.
                # A broken file is re-read each poll until fixed (it may be rewritten in the same second).
                if stat != self._stat or self.last_error is not None:
                    self.reload_if_changed()
            except Exception:
                log.exception("policy watcher error (continuing)")


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _read(path: Path) -> tuple[bytes, tuple[int, int] | None]:
    """The file's bytes and stamp; non-blocking, a regular file, at most the loader's limit
    (config_files/reading.py: a FIFO or a device swapped in must not stall or flood the watcher)."""
    try:
        stat = _stat(path)
        return read_operator_file(path), stat
    except OSError as exc:
        raise PolicyError([Problem(str(path), 1, 1, f"cannot read policy file: {exc}")]) from None

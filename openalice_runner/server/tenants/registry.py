"""The tenants in force: a request's key to its tenant (by the key's hash, compared in constant time),
and each tenant's rate limit. Replaced whole on a reload (one assignment), so a request reads one
consistent set."""

from __future__ import annotations

import hashlib
import hmac
import math
import threading
import time
from collections.abc import Callable, Iterable

from openalice_runner.server.tenants.tenant import Tenant

DEFAULT_TENANT = "default"  # the one tenant of `serve --api-key`


class TenantKeys:
    def __init__(self, entries: Iterable[tuple[str, Tenant]]) -> None:
        self._entries: tuple[tuple[bytes, Tenant], ...] = tuple((bytes.fromhex(h), t) for h, t in entries)

    @classmethod
    def single(cls, api_key: str) -> TenantKeys:
        """`--api-key KEY`: one tenant, "default", with the serve defaults."""
        return cls([(hashlib.sha256(api_key.encode()).hexdigest(), Tenant(DEFAULT_TENANT))])

    def replace(self, entries: Iterable[tuple[str, Tenant]]) -> None:
        self._entries = TenantKeys(entries)._entries

    @property
    def tenants(self) -> list[Tenant]:
        return [t for _, t in self._entries]

    def find(self, key: bytes) -> Tenant | None:
        """The tenant whose key is `key`, or None. Every entry is compared, in constant time: how long
        it takes tells neither which entry matched nor how much of a guess was right."""
        digest = hashlib.sha256(key).digest()
        found = None
        for stored, tenant in self._entries:  # one read of the tuple: a reload cannot mix two sets
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found


class RateLimiter:
    """Requests per minute per tenant: a bucket of `requests_per_minute` that refills evenly over the
    minute (a burst of a minute's requests, then one every 60/N s). `check` answers None (go) or the
    seconds until the next request would be let in."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, tuple[int, float, float]] = {}  # name -> (limit, tokens, at)
        self._lock = threading.Lock()

    def check(self, tenant: Tenant) -> float | None:
        limit = tenant.requests_per_minute
        if limit is None:
            return None
        now = self.clock()
        rate = limit / 60.0
        with self._lock:
            held, tokens, at = self._buckets.get(tenant.name, (limit, float(limit), now))
            if held != limit:  # the limit changed on a reload: start from the new one, full
                tokens, at = float(limit), now
            tokens = min(float(limit), tokens + (now - at) * rate)
            if tokens >= 1.0:
                self._buckets[tenant.name] = (limit, tokens - 1.0, now)
                return None
            self._buckets[tenant.name] = (limit, tokens, now)
            return (1.0 - tokens) / rate

    def forget_others(self, names: Iterable[str]) -> None:
        """Drop the buckets of tenants no longer in the keys file (a reload)."""
        keep = set(names)
        with self._lock:
            self._buckets = {k: v for k, v in self._buckets.items() if k in keep}


def retry_after_header(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}

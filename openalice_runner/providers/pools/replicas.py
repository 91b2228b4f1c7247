"""A pool's replicas: their load as last read, how it is read, and the order to try them in.

Replica choice (`rank_replicas`): with a conversation id, consistent hashing keeps a conversation
on one replica (its prefix cache lives there) as long as that replica's load stays within
`affinity_load_factor` of the pool's mean (consistent hashing with bounded loads); without one,
or past the bound, the least-loaded healthy replica. A replica whose load cannot be read has
unknown load: it goes after the ones whose load is known, and the runner logs it once.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from openalice_runner.providers.base import ProviderLoad
from openalice_runner.providers.pools.breaker import Breaker

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    url: str
    running: int | None = None
    waiting: int | None = None
    max_running: int | None = None  # the server's batch cap, where its load endpoint reports it
    read_at: float = 0.0  # monotonic time of the last load read
    down_until: float = 0.0
    load_endpoint: str | None = None  # the endpoint that answered last time
    in_flight: int = 0  # our own requests on it, counted between load reads
    unknown_logged: bool = False  # "load unknown" said once until it is read again
    breaker: Breaker = field(default_factory=Breaker)

    def age(self, now: float) -> float:
        """Seconds since the last load read; never read, infinite (monotonic time may be younger
        than `load_cache_s` on a fresh machine: 0.0 is no reading)."""
        return now - self.read_at if self.read_at else float("inf")

    @property
    def load(self) -> float:
        if self.running is None:
            return float("inf")
        return self.running + (self.waiting or 0) + self.in_flight


Figures = tuple[int, int, int | None]  # running, waiting, max running (None: not reported)
LoadReader = Callable[[httpx.AsyncClient, str, float], Awaitable["Figures | None"]]


async def read_replica_load(
    client: httpx.AsyncClient, replica: Replica, timeout: float, readers: dict[str, LoadReader]
) -> None:
    """Fill `replica.running/waiting` from whichever load endpoint the server offers."""
    order = list(readers)
    if replica.load_endpoint in readers:
        order.remove(replica.load_endpoint)
        order.insert(0, replica.load_endpoint)
    for endpoint in order:
        try:
            figures = await readers[endpoint](client, replica.url, timeout)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            figures = None
        if figures is not None:
            replica.running, replica.waiting, cap = figures
            if cap is not None:  # a server that reports its cap; else what the launch says stays
                replica.max_running = cap
            replica.load_endpoint = endpoint
            replica.read_at = time.monotonic()
            replica.in_flight = 0
            replica.unknown_logged = False
            return
    replica.running = replica.waiting = None
    replica.read_at = time.monotonic()
    if not replica.unknown_logged:
        replica.unknown_logged = True
        logger.warning(
            "replica %s: load unknown (no answer from %s); the policy sees an unknown batch size",
            replica.url,
            ", ".join(order),
        )


def parse_prometheus_sum(text: str, metric: str) -> float | None:
    """Sum of all samples of one metric (over label sets) in Prometheus text format."""
    total = None
    for line in text.splitlines():
        if not line.startswith(metric) or line.startswith("#"):
            continue
        rest = line[len(metric) :]
        if rest and rest[0] not in "{ ":
            continue  # a longer metric name sharing the prefix
        try:
            value = float(rest.rsplit(None, 1)[-1] if "}" not in rest else rest.split("}", 1)[1].split()[0])
        except (ValueError, IndexError):
            continue
        total = (total or 0.0) + value
    return total


def _affinity_score(key: str, url: str) -> int:
    """Rendezvous (highest-random-weight) hashing: a stable order of replicas per key, which moves
    only the keys of a replica that leaves or joins."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest(), "big")


def rank_replicas(
    replicas: list[Replica], key: str | None, now: float, load_factor: float
) -> list[Replica]:
    """Replicas in the order to try them: healthy before marked-down ones; among the healthy, with
    a key, its hash order while within the load bound, then the rest least loaded first; without
    a key, least loaded first (unknown load last)."""
    up = [r for r in replicas if r.down_until <= now]
    down = sorted((r for r in replicas if r.down_until > now), key=lambda r: r.load)
    by_load = sorted(up, key=lambda r: r.load)
    if key is None or load_factor <= 0 or len(up) < 2:
        return by_load + down
    known = [r.load for r in up if r.running is not None]
    order = sorted(up, key=lambda r: _affinity_score(key, r.url), reverse=True)
    if not known:  # nothing to bound by: keep the conversation where it hashes
        return order + down
    bound = load_factor * (sum(known) + 1) / len(known) + 1
    within = [r for r in order if r.running is not None and r.load + 1 <= bound]
    rest = [r for r in by_load if r not in within]
    return within + rest + down


def least_loaded(replicas: list[Replica]) -> ProviderLoad:
    known = [(r, r.running) for r in replicas if r.running is not None]
    if not known:
        return ProviderLoad(unknown=True)
    best, running = min(known, key=lambda pair: pair[0].load)
    return ProviderLoad(
        batch_size=running + best.in_flight, queue_depth=best.waiting, max_batch=best.max_running
    )

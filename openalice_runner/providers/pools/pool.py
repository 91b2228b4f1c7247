"""Self-hosted engine pools: the model SGLang and vLLM share, and the one replica attempt loop.

Both engines fix speculation per server at launch, so the runner realises a policy by routing:
the plan's `pool` (or, failing that, the pool whose method matches the plan's method, or
the default pool) picks the pool; inside it one replica serves. A dialect (providers/pools/sglang/provider.py,
providers/pools/vllm/provider.py) says what differs: how a replica's load is read, what the request body adds,
where the per-request speculation figures come back, and the engine's name in messages.

Replica choice (`rank_replicas`): with a conversation id, consistent hashing keeps a conversation
on one replica (its prefix cache lives there) as long as that replica's load stays within
`affinity_load_factor` of the pool's mean (consistent hashing with bounded loads); without one,
or past the bound, the least-loaded healthy replica. A replica whose load cannot be read has
unknown load: it goes after the ones whose load is known, and the runner logs it once.

One attempt loop (`_over_replicas`) serves plain and streamed calls: a replica that refuses the
connection, answers 5xx, or whose stream ends before its first token is marked down for
`down_for_s` (tried last meanwhile) and the next one is tried; one that gives no first token within
`first_token_timeout_s` is suspect (providers/pools/breaker.py): the call moves on to the next
replica, later calls skip it, and a probe after `suspect_for_s` brings it back. Once a token went
out a failure is StreamBroken.

The runner's own requests are counted on the replica whose load they join, between load reads
(`Replica.in_flight`): the replica itself, or, behind a gateway (`load_from`), the least-loaded
worker, which is where the gateway's reading says the request goes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass, field
from typing import Any

import httpx
from pydantic import Field, field_validator, model_validator

from openalice_runner.config_files.models import StrictModel
from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import (
    CallContext,
    Capabilities,
    Provider,
    ProviderBadRequest,
    ProviderBadResponse,
    ProviderError,
    ProviderLoad,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.pools.breaker import Breaker
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.admission import AdmissionLimits
from openalice_runner.redaction import register_secret
from openalice_runner.speculation import SpecMethod, SpeculationOutcome, SpeculationPlan
from openalice_runner.types import (
    CONVERSATION_HEADER,
    AllowedToolChoice,
    ChatChunk,
    ChatRequest,
    ChatResult,
    SpeculationInfo,
    Usage,
)

logger = logging.getLogger(__name__)

# How long a stream's body may go on after `[DONE]` before its connection is given up (_drain).
DRAIN_S = 1.0
# What a probe of a suspect replica asks (breaker.py): one token, the least a server can answer.
_PROBE = ChatRequest(messages=[{"role": "user", "content": "ping"}], max_tokens=1)

# ---------------------------------------------------------------- config


class PoolBase(StrictModel):
    """What every pool has: its replicas' base URLs (e.g. http://10.0.0.5:30000). A dialect adds
    its `launch` settings and how γ follows from them."""

    replicas: list[str] = Field(min_length=1)
    # Where `replicas` is a gateway (smg) in front of the pool's workers: the workers, read for the
    # pool's load (the gateway's /metrics are its own), while requests go to the gateway.
    load_from: list[str] | None = Field(None, min_length=1)

    @field_validator("replicas", "load_from")
    @classmethod
    def _urls(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica {url!r} must be an http(s) URL")
        return [u.rstrip("/") for u in v]

    @property
    def method(self) -> SpecMethod:
        raise NotImplementedError

    @property
    def adaptive(self) -> bool:  # γ varies per round (SGLang adaptive, vLLM per-batch-size table)
        return False

    def gamma_for(self, plan: SpeculationPlan | None = None) -> int:
        raise NotImplementedError


def plan_gamma(plan: SpeculationPlan | None) -> int | None:
    """The deciding rule's largest γ (an auto rule's range even where auto chose off: the pool's
    servers draft regardless); None without a plan or with one that never speculates."""
    if plan is None:
        return None
    if plan.gamma_range:
        return plan.gamma_range[1]
    return plan.gamma or None


class PoolConfigBase(AdmissionLimits):  # max_in_flight / max_queue: the gate in front of it
    model: str  # the served model name the servers answer to
    pools: dict[str, Any]  # a dialect narrows it to its own pool class
    default_pool: str | None = None
    api_key_env: str | None = None  # env var holding the servers' --api-key, if set
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_token_timeout_s: float = Field(default=60.0, gt=0)  # also the gap allowed between chunks
    load_cache_s: float = Field(default=0.5, ge=0)
    # A reading older than load_cache_s but younger than this is used at once, and a fresh one is
    # read in the background once the call ends: a /metrics scrape (~15 ms of a busy CPU server's
    # time) is then neither waited for nor run beside the request it would slow. Older readings
    # are waited for. The runner's own requests since a reading are counted either way
    # (Replica.in_flight); only other clients' load can be this old.
    load_stale_s: float = Field(default=2.0, ge=0)
    load_timeout_s: float = Field(default=0.5, gt=0)
    down_for_s: float = Field(default=2.0, ge=0)  # how long a refusing replica is skipped
    # How long a replica that gave no first token in time is skipped before a probe (breaker.py);
    # doubled after each failed probe.
    suspect_for_s: float = Field(default=10.0, gt=0)
    # A conversation stays on its replica (its prefix cache) while that replica's load is at most
    # this factor of the pool's mean load (+1); 0 turns affinity off (least-loaded alone).
    affinity_load_factor: float = Field(default=1.5, ge=0)

    @model_validator(mode="after")
    def _default_pool_exists(self) -> PoolConfigBase:
        if self.default_pool is None:
            self.default_pool = next(iter(self.pools))
        elif self.default_pool not in self.pools:
            raise ValueError(f"default_pool {self.default_pool!r} is not one of the pools {list(self.pools)}")
        return self


# ---------------------------------------------------------------- replica load


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


def _least_loaded(replicas: list[Replica]) -> ProviderLoad:
    known = [(r, r.running) for r in replicas if r.running is not None]
    if not known:
        return ProviderLoad(unknown=True)
    best, running = min(known, key=lambda pair: pair[0].load)
    return ProviderLoad(
        batch_size=running + best.in_flight, queue_depth=best.waiting, max_batch=best.max_running
    )


# ---------------------------------------------------------------- the provider


class _NextReplica(Exception):
    """This replica failed before anything went out: mark it down, try the next."""


class PoolProvider(Provider):
    """A provider over pools of OpenAI-compatible engine servers; subclasses are the dialects."""

    engine = "engine"  # the engine's name in messages ("SGLang", "vLLM")

    def __init__(self, name: str, config: PoolConfigBase, client: httpx.AsyncClient | None = None) -> None:
        self.name = name
        self.config = config
        methods = frozenset(p.method for p in config.pools.values())
        self.capabilities = Capabilities(tools=True, streaming=True, spec_methods=methods)
        self.pools: dict[str, list[Replica]] = {
            pool_name: [Replica(url) for url in pool.replicas] for pool_name, pool in config.pools.items()
        }
        # Whose load a pool's requests join: its replicas, or the workers behind its gateway.
        self.load_sources: dict[str, list[Replica]] = {
            pool_name: [Replica(url) for url in pool.load_from] if pool.load_from else self.pools[pool_name]
            for pool_name, pool in config.pools.items()
        }
        headers = {}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ValueError(f"provider {name!r}: environment variable {config.api_key_env} is not set")
            register_secret(key)
            headers["Authorization"] = f"Bearer {key}"
        self._client = client or httpx.AsyncClient(headers=headers)
        self._owns_client = client is None
        self._refresh_lock = asyncio.Lock()
        self._background_refresh: asyncio.Task | None = None
        self._stale: dict[int, Replica] = {}  # readings to renew after the current calls (by id)
        self._probes: set[asyncio.Task] = set()  # suspect replicas' probes in flight
        self.clock: Callable[[], float] = time.monotonic  # marks and cool-downs (a test turns it)

    # ---- the dialect ----

    def load_readers(self) -> dict[str, LoadReader]:
        raise NotImplementedError

    def body(self, request: ChatRequest, stream: bool, ctx: CallContext | None = None) -> dict[str, Any]:
        body = wire.request_body(request, self.config.model)
        if ctx is not None and ctx.tenant is not None:
            # vLLM's and SGLang's own per-request prefix-cache isolation: a tenant's cached prefixes
            # serve that tenant only (docs/security.md, "Tenants")
            body["cache_salt"] = cache_salt(ctx.tenant)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        choice = request.tool_choice
        if isinstance(choice, AllowedToolChoice):
            # neither SGLang 0.5.23's nor vLLM 0.32's ChatCompletionRequest has the allowed_tools
            # form: the same calls, as only the allowed tools under the plain mode
            allowed = set(choice.allowed_tools.names)
            body["tools"] = [t for t in body["tools"] if t["function"]["name"] in allowed]
            body["tool_choice"] = choice.allowed_tools.mode
        return body

    def capture(self, ext: dict[str, Any], data: dict[str, Any]) -> None:
        """Keep what the dialect's speculation figures need from a response or stream event."""

    def spec_figures(self, ext: dict[str, Any], pool: str, gamma: int, usage: Usage | None) -> dict[str, Any]:
        """SpeculationOutcome figures from what `capture` kept ({} when there are none); `usage`
        None where the server sent none."""
        return {}

    def request_error(self, resp: httpx.Response) -> ProviderError:
        return http_error(resp, self.name)

    # ---- load and choice ----

    @property
    def model_names(self) -> list[str]:
        return [self.config.model]

    def _all_load_sources(self) -> list[Replica]:
        return [r for replicas in self.load_sources.values() for r in replicas]

    def load(self) -> ProviderLoad:
        """The least-loaded replica's figures (what a request joining now would see); unknown
        (`ProviderLoad(unknown=True)`) where no replica's load could be read."""
        return _least_loaded(self._all_load_sources())

    def pool_load(self, pool: str) -> ProviderLoad | None:
        """The load a request joining `pool` would see: its least-loaded replica's."""
        replicas = self.load_sources.get(pool)
        if replicas is None:
            return None
        return _least_loaded(replicas)

    async def current_load(self) -> ProviderLoad:
        await self.refresh_loads()
        return self.load()

    async def refresh_loads(self, replicas: list[Replica] | None = None) -> None:
        """Bring the replicas' load readings up to date: fresh ones (under `load_cache_s`) stay,
        stale ones still under `load_stale_s` are used and re-read in the background after the
        call (`_renew_stale`), older or never read ones are read now, concurrent requests sharing
        one round of reads."""
        replicas = replicas or self._all_load_sources()
        now = time.monotonic()
        stale = [r for r in replicas if r.age(now) >= self.config.load_cache_s]
        if not stale:
            return
        must_wait = [r for r in stale if r.age(now) >= self.config.load_stale_s]
        if not must_wait:
            self._stale.update((id(r), r) for r in stale)
            return
        await self._read_loads(must_wait)

    def _renew_stale(self) -> None:
        """After a call: read the stale loads in the background, one round at a time."""
        if not self._stale or (self._background_refresh is not None and not self._background_refresh.done()):
            return
        replicas, self._stale = list(self._stale.values()), {}
        self._background_refresh = asyncio.get_running_loop().create_task(self._read_loads(replicas))

    async def _read_loads(self, replicas: list[Replica]) -> None:
        async with self._refresh_lock:
            now = time.monotonic()
            stale = [r for r in replicas if r.age(now) >= self.config.load_cache_s]
            readers = self.load_readers()
            await asyncio.gather(
                *(read_replica_load(self._client, r, self.config.load_timeout_s, readers) for r in stale)
            )

    def choose_pool(self, ctx: CallContext) -> str:
        plan = ctx.plan
        pool = plan.pool if plan is not None else None
        if pool:
            if pool in self.pools:
                return pool
            logger.warning("%s: policy pool %r is not configured; choosing by method", self.name, pool)
        method = plan.method if plan is not None else None
        if method:
            for name, cfg in self.config.pools.items():
                if cfg.method == method:
                    return name
        default = self.config.default_pool
        if default is None:  # the config's validator fills it in; a config built around it has none
            raise ValueError(f"{self.name}: no default_pool")
        return default

    async def ranked_replicas(self, pool: str, conversation_id: str | None = None) -> list[Replica]:
        """The pool's replicas in the order to try them, suspect ones left out (a probe starts for
        each whose cool-down is over)."""
        now = self.clock()
        for replica in self.pools[pool]:
            if replica.breaker.probe_due(now):
                self._start_probe(replica)
        replicas = [r for r in self.pools[pool] if not r.breaker.suspect]
        if not replicas:
            return []
        await self.refresh_loads(self.load_sources[pool])
        return rank_replicas(replicas, conversation_id, now, self.config.affinity_load_factor)

    def _counted_on(self, pool: str, replica: Replica) -> Replica:
        """Where a call's own in-flight count goes: the replica, or behind a gateway the worker
        with the least load (the gateway's choice is not known; its workers' readings are the
        pool's load, so the call must count on one of them, else the policy sees the batch as
        it was at the last reading, up to `load_stale_s` old)."""
        if self.config.pools[pool].load_from is None:
            return replica
        return min(self.load_sources[pool], key=lambda r: r.load)

    # ---- the attempt loop ----

    def _timeout(self) -> httpx.Timeout:
        c = self.config
        return httpx.Timeout(c.first_token_timeout_s, connect=c.connect_timeout_s)

    async def _over_replicas(
        self,
        pool: str,
        ctx: CallContext,
        attempt: Callable[[Replica], AsyncGenerator[Any, None]],
    ) -> AsyncGenerator[Any, None]:
        """What `attempt(replica)` yields, from the first replica that serves: one loop for plain
        calls (one item) and streams (chunks)."""
        errors: list[str] = []
        timed_out = False
        ranked = await self.ranked_replicas(pool, ctx.scoped_conversation)  # affinity per tenant's conversation
        if not ranked:
            raise self._all_suspect(pool)
        for replica in ranked:
            counted = {id(r): r for r in (replica, self._counted_on(pool, replica))}.values()
            for r in counted:
                r.in_flight += 1
            yielded = False
            try:
                async with aclosing(attempt(replica)) as items:
                    async for item in items:
                        yielded = True
                        yield item
                return
            except _NextReplica as exc:
                self._mark_down(replica, errors, f"{replica.url}: {exc}")
            except httpx.PoolTimeout as exc:  # the runner's own connection pool, not the replica
                raise ProviderTimeout(f"no connection to {replica.url} free in time", provider=self.name) from exc
            except httpx.TimeoutException as exc:
                self._suspect(replica, exc, errors, after_tokens=yielded)
                if yielded:
                    raise StreamBroken(f"{self.engine} stream stalled: {exc!r}", provider=self.name) from exc
                timed_out = True
            except httpx.TransportError as exc:
                if yielded:
                    raise StreamBroken(f"{self.engine} stream broke: {exc!r}", provider=self.name) from exc
                self._mark_down(replica, errors, f"{replica.url}: {exc!r}")
            finally:
                for r in counted:
                    r.in_flight = max(0, r.in_flight - 1)
                self._renew_stale()
        failed = ProviderTimeout if timed_out else ProviderUnavailable
        raise failed(f"no replica of pool {pool!r} served: {'; '.join(errors)}", provider=self.name)

    def _mark_down(self, replica: Replica, errors: list[str], why: str) -> None:
        replica.down_until = self.clock() + self.config.down_for_s
        errors.append(why)
        logger.warning("%s: replica failed before the first token, trying the next: %s", self.name, why)

    def _suspect(self, replica: Replica, exc: Exception, errors: list[str], after_tokens: bool) -> None:
        """A timeout on `replica`: open its breaker (the call moves on; later calls skip it)."""
        limit = self.config.first_token_timeout_s
        why = f"no {'next chunk' if after_tokens else 'first token'} within {limit:g} s ({type(exc).__name__})"
        errors.append(f"{replica.url}: {why}")
        if replica.breaker.open(self.clock(), self.config.suspect_for_s, why):
            logger.warning("%s: replica %s is suspect (%s); skipped until a probe in %g s finds it answering",
                           self.name, replica.url, why, self.config.suspect_for_s)  # fmt: skip

    def _all_suspect(self, pool: str) -> ProviderUnavailable:
        now = self.clock()
        replicas = self.pools[pool]
        wait = max(0.0, min(r.breaker.probe_at for r in replicas) - now)
        whys = "; ".join(f"{r.url}: {r.breaker.why}" for r in replicas)
        return ProviderUnavailable(
            f"every replica of pool {pool!r} is suspect ({whys}); the next probe in {wait:.0f} s",
            provider=self.name,
            retry_after=wait,
        )

    # ---- suspect replicas' probes ----

    def _start_probe(self, replica: Replica) -> None:
        replica.breaker.probing = True
        task = asyncio.get_running_loop().create_task(self._probe(replica))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, replica: Replica) -> None:
        """One one-token request of the runner's own to a suspect replica: any answer short of a
        5xx within the first-token timeout closes its breaker; else it opens again, for longer."""
        body = self.body(_PROBE, stream=False)
        try:
            resp = await self._client.post(f"{replica.url}/v1/chat/completions", json=body, timeout=self._timeout())
            failure = f"the probe got HTTP {resp.status_code}" if resp.status_code >= 500 else None
        except httpx.HTTPError as exc:
            failure = f"the probe got no answer ({type(exc).__name__})"
        finally:
            replica.breaker.probing = False
        if failure is None:
            replica.breaker.close()
            logger.warning("%s: replica %s answers again; it serves", self.name, replica.url)
            return
        wait = replica.breaker.probe_failed(self.clock(), self.config.suspect_for_s, failure)
        logger.warning("%s: replica %s still suspect (%s); the next probe in %g s", self.name, replica.url, failure, wait)

    async def wait_probes(self) -> None:
        """Wait for the probes in flight (a test, or a caller that wants their verdicts now)."""
        while self._probes:
            await asyncio.gather(*list(self._probes), return_exceptions=True)

    # ---- plain ----

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        pool = self.choose_pool(ctx)
        body = self.body(request, stream=False, ctx=ctx)

        async def attempt(replica: Replica) -> AsyncGenerator[ChatResult, None]:
            resp = await self._client.post(f"{replica.url}/v1/chat/completions", json=body, timeout=self._timeout(),
                                           headers=_upstream_headers(ctx))
            if resp.status_code >= 500:
                raise _NextReplica(f"HTTP {resp.status_code} {error_message(resp)}")
            if resp.status_code != 200:
                raise self.request_error(resp)
            yield self._result(resp, pool, ctx)

        async with aclosing(self._over_replicas(pool, ctx, attempt)) as results:
            async for result in results:
                return result
        raise ProviderUnavailable(f"{self.engine} returned nothing", provider=self.name)  # pragma: no cover

    def _result(self, resp: httpx.Response, pool: str, ctx: CallContext) -> ChatResult:
        try:
            data = resp.json()
        except ValueError as exc:
            raise ProviderBadResponse(
                f"{self.engine} answered 200 with a body that is not JSON: {exc}", provider=self.name
            ) from None
        body = wire.read_response(data, self.name)
        choice = body.choices[0]
        finish = choice.finish_reason  # required by the reader: a reply without one is a bad_response
        if finish == "abort":  # the server dropped the request; nothing usable came back
            raise ProviderUnavailable(f"{self.engine} aborted the request", provider=self.name)
        usage = wire.usage_of(body.usage)  # None where the server sent none: unknown, never zeros
        tool_calls = wire.tool_calls_of(choice.message, self.name, finish)
        ext: dict[str, Any] = {}
        self.capture(ext, data)
        outcome = self._speculation(ext, pool, ctx, usage)
        result = ChatResult.single(
            id=body.id,
            model=body.model or self.config.model,
            # SGLang sends content "" beside tool calls; OpenAI's shape has null there
            content=choice.message.content or (None if tool_calls else ""),
            tool_calls=tool_calls,
            finish_reason=wire.finish_reason(finish, bool(tool_calls), self.name),
            usage=usage,
            speculation=SpeculationInfo.from_outcome(outcome),
            provider=self.name,
        )
        return result.attach_outcome(outcome)

    def _speculation(
        self, ext: dict[str, Any], pool: str, ctx: CallContext, usage: Usage | None
    ) -> SpeculationOutcome:
        cfg = self.config.pools[pool]
        plan = ctx.plan
        gamma = cfg.gamma_for(plan)
        figures = self.spec_figures(ext, pool, gamma, usage) if cfg.method != "off" else {}
        return SpeculationOutcome(
            method=cfg.method,
            gamma=gamma,
            # unknown usage: the outcome's count is an int; pools set no total_s, so no rate comes of it
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            rule=plan.rule if plan is not None else None,
            policy_version=plan.policy_version if plan is not None else None,
            pool=pool,
            **figures,
        )

    # ---- streamed ----

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        return chat_stream(self._stream(request, ctx))

    async def _stream(self, request: ChatRequest, ctx: CallContext) -> AsyncGenerator[ChatChunk, None]:
        pool = self.choose_pool(ctx)
        body = self.body(request, stream=True, ctx=ctx)

        async def attempt(replica: Replica) -> AsyncGenerator[ChatChunk, None]:
            async with self._client.stream(
                "POST", f"{replica.url}/v1/chat/completions", json=body, timeout=self._timeout(),
                headers=_upstream_headers(ctx),
            ) as resp:
                if resp.status_code >= 500:
                    await resp.aread()
                    raise _NextReplica(f"HTTP {resp.status_code} {error_message(resp)}")
                if resp.status_code != 200:
                    await resp.aread()
                    raise self.request_error(resp)
                async with aclosing(self._chunks(resp, pool, ctx)) as chunks:
                    async for chunk in chunks:
                        yield chunk

        async with aclosing(self._over_replicas(pool, ctx, attempt)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _chunks(
        self, resp: httpx.Response, pool: str, ctx: CallContext
    ) -> AsyncGenerator[ChatChunk, None]:
        """SSE events -> ChatChunks. A failure before the first chunk tries the next replica
        (transport errors reach the attempt loop as they are); after it, StreamBroken."""
        acc = wire.ChunkAccumulator(self.config.model)
        ext: dict[str, Any] = {}
        engine = self.engine
        lines = resp.aiter_lines()
        try:
            async for line in lines:
                if not line.startswith("data:"):
                    continue  # comments, `event:` lines (SGLang's framed `sglext_ids`), blanks
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if isinstance(data, dict) and "error" in data:
                    raise self._stream_error(data["error"], acc.started)
                if isinstance(data, dict):
                    self.capture(ext, data)
                for chunk in acc.feed(wire.read_chunk(data, self.name)):
                    yield chunk
        except (json.JSONDecodeError, ProviderBadResponse) as exc:
            if acc.started:
                raise StreamBroken(f"{engine} stream unreadable: {exc}", provider=self.name) from exc
            if isinstance(exc, ProviderBadResponse):
                raise
            raise ProviderBadResponse(f"{engine} stream event is not JSON: {exc}", provider=self.name) from exc
        self._check_stream_end(acc)
        usage = acc.usage  # None where the server sent none (no usage chunk): unknown
        outcome = self._speculation(ext, pool, ctx, usage)
        yield acc.final(SpeculationInfo.from_outcome(outcome), self.name).attach_outcome(outcome)
        await _drain(lines)

    def _stream_error(self, body: Any, started: bool) -> Exception:
        """An SSE `error` event: StreamBroken once tokens went out; before, the next replica where
        the error allows a fallback, else the error itself."""
        err = error_from_body(body, self.name)
        if started:
            return StreamBroken(f"{self.engine} stream error: {err.message}", provider=self.name)
        if err.fallback_ok:
            return _NextReplica(f"stream error before the first token: {err.message}")
        return err

    def _check_stream_end(self, acc: wire.ChunkAccumulator) -> None:
        """A stream that ended without a finish, or aborted: broken after tokens, else retried or refused."""
        engine = self.engine
        if acc.finish is None:
            if acc.started:
                raise StreamBroken(f"{engine} stream ended without a finish_reason", provider=self.name)
            raise _NextReplica("stream ended before any token")
        if acc.finish == "abort":
            if acc.started:
                raise StreamBroken(f"{engine} aborted the request mid-stream", provider=self.name)
            raise ProviderUnavailable(f"{engine} aborted the request", provider=self.name)

    async def aclose(self) -> None:
        for probe in list(self._probes):
            probe.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        if self._background_refresh is not None and not self._background_refresh.done():
            self._background_refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._background_refresh
        if self._owns_client:
            await self._client.aclose()


# ---------------------------------------------------------------- errors


def _error_object(data: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-style {"error": {...}} inside a JSON error body, else the body itself."""
    error = data.get("error")
    return error if isinstance(error, dict) else data


def error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(data, dict):
        inner = _error_object(data)
        return str(inner.get("message") or inner.get("detail") or data)[:500]
    return str(data)[:200]


def error_param(resp: httpx.Response) -> str | None:
    try:
        data = resp.json()
    except ValueError:
        return None
    if isinstance(data, dict):
        inner = _error_object(data)
        param = inner.get("param")
        return str(param) if param else None
    return None


def http_error(resp: httpx.Response, provider: str, param: str | None = None) -> ProviderError:
    message = error_message(resp)
    code = resp.status_code
    if code == 429:
        return ProviderRateLimited(
            message, provider=provider, status_code=code, retry_after=wire.retry_after(resp.headers)
        )
    if code in (408, 504):
        return ProviderTimeout(message, provider=provider, status_code=code)
    if code >= 500:
        return ProviderUnavailable(message, provider=provider, status_code=code)
    return ProviderBadRequest(message, provider=provider, status_code=code, param=param or error_param(resp))


def error_from_body(err: Any, provider: str) -> ProviderError:
    if not isinstance(err, dict):
        return ProviderUnavailable(str(err), provider=provider)
    message = str(err.get("message") or err)
    try:
        code = int(err.get("code") or 500)
    except (TypeError, ValueError):
        code = 500
    if code == 429:
        return ProviderRateLimited(message, provider=provider, status_code=code)
    if code >= 500:
        return ProviderUnavailable(message, provider=provider, status_code=code)
    return ProviderBadRequest(message, provider=provider, status_code=code, param=err.get("param") or None)


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read what follows `[DONE]` (the chunked body's end): a response read to its end hands its
    connection back to the pool; one left unread is closed, and the next call pays a new connect.
    A server that keeps the body open past `[DONE]` gets DRAIN_S, then its connection is closed."""
    with contextlib.suppress(TimeoutError, httpx.HTTPError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass


CACHE_SALT_DOMAIN = b"openalice-runner cache_salt v1\0"


def cache_salt(tenant: str) -> str:
    """The `cache_salt` a tenant's requests carry upstream: from its name (never its key), 256 bits as
    43 base64url characters, as vLLM's field asks (base64url: vLLM 0.32 refuses a salt with `/`).
    Derived, not random: every runner in front of the same pool gives a tenant the same salt, so its
    prefixes are shared across runners and restarts (the salt is a namespace, not a secret: clients
    reach the runner, never the pools directly)."""
    digest = hashlib.sha256(CACHE_SALT_DOMAIN + tenant.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _upstream_headers(ctx: CallContext) -> dict[str, str]:
    """The conversation id, sent on: a gateway in front of a pool's workers (smg `--policy
    consistent_hashing --routing-key-headers x-openalice-conversation-id`) keys each conversation
    to the worker that holds its prefix cache. Scoped by the tenant: the same id from two tenants is two
    conversations."""
    conversation = ctx.scoped_conversation
    return {CONVERSATION_HEADER: conversation} if conversation else {}

"""Self-hosted engine pools: the model SGLang and vLLM share, and the one replica attempt loop.

Both engines fix speculation per server at launch, so the runner realises a policy by routing:
the plan's `pool` (or, failing that, the pool whose method matches the plan's method, or
the default pool) picks the pool; inside it one replica serves. A dialect (providers/pools/sglang/provider.py,
providers/pools/vllm/provider.py) says what differs: how a replica's load is read, what the request body adds,
where the per-request speculation figures come back, and the engine's name in messages.

Beside it: the routing file's entry (config.py); replicas, their load and the order to try them
in (replicas.py); a server's errors (errors.py); a streamed reply's reading (streaming.py); what a
request carries besides its body (upstream.py).

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
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any

import httpx

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import (
    CallContext,
    Capabilities,
    Provider,
    ProviderBadResponse,
    ProviderError,
    ProviderLoad,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.pools.config import PoolConfigBase
from openalice_runner.providers.pools.errors import NextReplica, error_message, http_error
from openalice_runner.providers.pools.replicas import (
    LoadReader,
    Replica,
    least_loaded,
    rank_replicas,
    read_replica_load,
)
from openalice_runner.providers.pools.streaming import sse_chunks
from openalice_runner.providers.pools.upstream import request_body, upstream_headers
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.redaction import register_secret
from openalice_runner.speculation import SpeculationOutcome
from openalice_runner.types import (
    ChatChunk,
    ChatRequest,
    ChatResult,
    SpeculationInfo,
    Usage,
)

logger = logging.getLogger(__name__)

# What a probe of a suspect replica asks (breaker.py): one token, the least a server can answer.
_PROBE = ChatRequest(messages=[{"role": "user", "content": "ping"}], max_tokens=1)


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
        return request_body(request, self.config.model, stream, ctx.tenant if ctx is not None else None)

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
        return least_loaded(self._all_load_sources())

    def pool_load(self, pool: str) -> ProviderLoad | None:
        """The load a request joining `pool` would see: its least-loaded replica's."""
        replicas = self.load_sources.get(pool)
        if replicas is None:
            return None
        return least_loaded(replicas)

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
            except NextReplica as exc:
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
                                           headers=upstream_headers(ctx))
            if resp.status_code >= 500:
                raise NextReplica(f"HTTP {resp.status_code} {error_message(resp)}")
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
        outcome = self.speculation(ext, pool, ctx, usage)
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

    def speculation(
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
                headers=upstream_headers(ctx),
            ) as resp:
                if resp.status_code >= 500:
                    await resp.aread()
                    raise NextReplica(f"HTTP {resp.status_code} {error_message(resp)}")
                if resp.status_code != 200:
                    await resp.aread()
                    raise self.request_error(resp)
                async with aclosing(sse_chunks(self, resp, pool, ctx)) as chunks:
                    async for chunk in chunks:
                        yield chunk

        async with aclosing(self._over_replicas(pool, ctx, attempt)) as chunks:
            async for chunk in chunks:
                yield chunk

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

"""SGLang provider: self-hosted SGLang servers grouped into pools, one speculation setting per pool.

SGLang fixes speculation per server at launch (`--speculative-algorithm EAGLE3|NGRAM`, ...), so the
runner realises a policy by routing: the Decision's `pool` (or, failing that, the pool whose method
matches the Decision's method, or the default pool) picks the pool; inside it the least-loaded
replica serves. Replica load comes from the server itself, cached for `load_cache_s`:
  GET /v1/loads?include=core   -> {"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}
  GET /metrics                 -> Prometheus `sglang:num_running_reqs`, `sglang:num_queue_reqs`
                                  (only on servers launched with --enable-metrics)
the first that answers is remembered per replica (SGLang 0.5.23 has no /get_load route).
`num_running_reqs` is SGLang's running decode batch, capped by --max-running-requests; it is what
an adaptive pool picks its `--speculative-adaptive-config` slot by.

Requests go to `/v1/chat/completions` (OpenAI-compatible, read by `openai_wire`) with
`return_spec_tokens_details`: SGLang 0.5.23 then sends the speculation counters as
`sglext.spec_tokens_details` on the response, or on a chunk of its own after the finish chunk when
streaming (serving_chat.py). SGLang errors are `{"object": "error", "message", "type", "param",
"code"}` (non-streaming) or an SSE `data: {"error": {...}}` event (streaming).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from pydantic import Field, field_validator, model_validator

from openalice_runner.config_files.models import StrictModel
from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.admission import AdmissionLimits
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
from openalice_runner.providers.sglang_launch import SGLangLaunch
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.redaction import register_secret
from openalice_runner.speculation import SpecMethod, SpeculationOutcome
from openalice_runner.types import (
    AllowedToolChoice,
    ChatChunk,
    ChatRequest,
    ChatResult,
    SpeculationInfo,
    Usage,
)

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- config


class SGLangPool(StrictModel):
    """One pool of a routing file: where its servers are, and every flag they are launched with
    (`openalice-runner sglang args --pool P` prints them; the routing file is their one source)."""

    replicas: list[str] = Field(min_length=1)  # base URLs, e.g. http://10.0.0.5:30000
    launch: SGLangLaunch = Field(default_factory=SGLangLaunch)

    @field_validator("replicas")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica {url!r} must be an http(s) URL")
        return [u.rstrip("/") for u in v]

    @property
    def method(self) -> SpecMethod:
        return self.launch.method

    @property
    def adaptive(self) -> bool:
        return self.method != "off" and self.launch.adaptive

    def gamma_for(self, decision: Any = None) -> int:
        """Draft tokens per verify round (SGLang counts the target's own token in num_draft_tokens).
        Where the launch leaves it to the rules (an adaptive pool's steps vary per running batch;
        a pool without num_steps/num_draft_tokens took its γ from the rules routed to it), the
        deciding rule's γ: its upper bound, the most one round can draft for this request."""
        if self.method == "off":
            return 0
        launch = self.launch
        if not self.adaptive:
            if launch.num_draft_tokens:
                return launch.num_draft_tokens - 1
            if launch.num_steps:
                return launch.num_steps
        plan_gamma = _decision_gamma(decision)
        return plan_gamma if plan_gamma is not None else (launch.num_steps or 0)


def _decision_gamma(decision: Any) -> int | None:
    """The deciding rule's largest γ (an auto rule's range even where auto chose off: the pool's
    servers draft regardless); None without a decision or with one that never speculates."""
    if decision is None:
        return None
    bounds = getattr(decision, "gamma_range", None)
    if bounds:
        return int(bounds[1])
    return int(getattr(decision, "gamma", 0) or 0) or None


class SGLangConfig(AdmissionLimits):  # max_in_flight / max_queue: the gate in front of it
    type: Literal["sglang"]
    model: str  # the served model name the servers answer to
    pools: dict[str, SGLangPool] = Field(min_length=1)
    default_pool: str | None = None
    api_key_env: str | None = None  # env var holding the servers' --api-key, if set
    connect_timeout_s: float = Field(default=2.0, gt=0)
    first_token_timeout_s: float = Field(default=60.0, gt=0)  # also the gap allowed between chunks
    load_cache_s: float = Field(default=0.5, ge=0)
    load_timeout_s: float = Field(default=0.5, gt=0)
    down_for_s: float = Field(default=2.0, ge=0)  # how long a refusing replica is skipped

    @model_validator(mode="after")
    def _default_pool_exists(self) -> SGLangConfig:
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
    max_running: int | None = None  # --max-running-requests, as /v1/loads reports it
    read_at: float = 0.0  # monotonic time of the last load read
    down_until: float = 0.0
    load_endpoint: str | None = None  # the endpoint that answered last time
    in_flight: int = 0  # our own requests on it, counted between load reads

    @property
    def load(self) -> float:
        if self.running is None:
            return float("inf")
        return self.running + (self.waiting or 0) + self.in_flight


async def read_replica_load(client: httpx.AsyncClient, replica: Replica, timeout: float) -> None:
    """Fill `replica.running/waiting` from whichever load endpoint the server offers."""
    order = ["v1_loads", "metrics"]
    if replica.load_endpoint:
        order.remove(replica.load_endpoint)
        order.insert(0, replica.load_endpoint)
    for endpoint in order:
        try:
            figures = await _LOAD_READERS[endpoint](client, replica.url, timeout)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            figures = None
        if figures is not None:
            replica.running, replica.waiting, replica.max_running = figures
            replica.load_endpoint = endpoint
            replica.read_at = time.monotonic()
            replica.in_flight = 0
            return
    replica.running = replica.waiting = None
    replica.read_at = time.monotonic()


Figures = tuple[int, int, int | None]  # running, waiting, max running (None: not reported)


async def _read_v1_loads(client: httpx.AsyncClient, url: str, timeout: float) -> Figures | None:
    resp = await client.get(f"{url}/v1/loads", params={"include": "core"}, timeout=timeout)
    if resp.status_code != 200:
        return None
    loads = resp.json()["loads"]
    limits = [int(x["max_running_requests"]) for x in loads if x.get("max_running_requests")]
    return (
        sum(int(x.get("num_running_reqs") or 0) for x in loads),
        sum(int(x.get("num_waiting_reqs") or 0) for x in loads),
        sum(limits) if limits and len(limits) == len(loads) else None,
    )


async def _read_metrics(client: httpx.AsyncClient, url: str, timeout: float) -> Figures | None:
    resp = await client.get(f"{url}/metrics", timeout=timeout)
    if resp.status_code != 200:
        return None
    running = parse_prometheus_sum(resp.text, "sglang:num_running_reqs")
    if running is None:
        return None
    return int(running), int(parse_prometheus_sum(resp.text, "sglang:num_queue_reqs") or 0), None


_LOAD_READERS = {"v1_loads": _read_v1_loads, "metrics": _read_metrics}


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


# ---------------------------------------------------------------- provider


class SGLangProvider(Provider):
    kind = "sglang"
    gen_ai_provider_name = "sglang"

    def __init__(self, name: str, config: SGLangConfig, client: httpx.AsyncClient | None = None) -> None:
        self.name = name
        self.config = config
        methods = frozenset(p.method for p in config.pools.values())
        self.capabilities = Capabilities(tools=True, streaming=True, spec_methods=methods)
        self.pools: dict[str, list[Replica]] = {
            pool_name: [Replica(url) for url in pool.replicas] for pool_name, pool in config.pools.items()
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

    @property
    def model_names(self) -> list[str]:
        return [self.config.model]

    # ---- load and choice ----

    def _all_replicas(self) -> list[Replica]:
        return [r for replicas in self.pools.values() for r in replicas]

    def load(self) -> ProviderLoad:
        """The least-loaded replica's figures (what a request joining now would see); None if unread."""
        known = [r for r in self._all_replicas() if r.running is not None]
        if not known:
            return ProviderLoad()
        best = min(known, key=lambda r: r.load)
        return ProviderLoad(
            batch_size=best.running + best.in_flight, queue_depth=best.waiting, max_batch=best.max_running
        )

    async def current_load(self) -> ProviderLoad:
        await self.refresh_loads()
        return self.load()

    async def refresh_loads(self, replicas: list[Replica] | None = None) -> None:
        now = time.monotonic()
        stale = [r for r in (replicas or self._all_replicas()) if now - r.read_at >= self.config.load_cache_s]
        if not stale:
            return
        async with self._refresh_lock:  # concurrent requests share one round of reads
            now = time.monotonic()
            stale = [r for r in stale if now - r.read_at >= self.config.load_cache_s]
            await asyncio.gather(
                *(read_replica_load(self._client, r, self.config.load_timeout_s) for r in stale)
            )

    def choose_pool(self, ctx: CallContext) -> str:
        decision = ctx.decision
        pool = getattr(decision, "pool", None) if decision is not None else None
        if pool:
            if pool in self.pools:
                return pool
            logger.warning("%s: policy pool %r is not configured; choosing by method", self.name, pool)
        method = getattr(decision, "method", None) if decision is not None else None
        if method:
            for name, cfg in self.config.pools.items():
                if cfg.method == method:
                    return name
        return self.config.default_pool  # type: ignore[return-value]

    async def ranked_replicas(self, pool: str) -> list[Replica]:
        """Replicas of the pool, least loaded first; replicas marked down go last."""
        replicas = self.pools[pool]
        await self.refresh_loads(replicas)
        now = time.monotonic()
        return sorted(replicas, key=lambda r: (r.down_until > now, r.load))

    # ---- requests ----

    def _body(self, request: ChatRequest, stream: bool) -> dict[str, Any]:
        body = wire.request_body(request, self.config.model)
        choice = request.tool_choice
        if isinstance(choice, AllowedToolChoice):
            # SGLang 0.5.23's ChatCompletionRequest knows no allowed_tools form (tool_choice is a mode
            # or a named function): the same calls, as only the allowed tools under the plain mode
            allowed = set(choice.allowed_tools.names)
            body["tools"] = [t for t in body["tools"] if t["function"]["name"] in allowed]
            body["tool_choice"] = choice.allowed_tools.mode
        # SGLang 0.5.23 returns the per-request speculation counters as `sglext.spec_tokens_details`
        # (protocol.py SpecTokensDetails), on the response or, streaming, on a chunk of their own
        # after the finish chunk (serving_chat.py `_generate_chat_stream`). Nothing when off.
        body["return_spec_tokens_details"] = True
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _timeout(self) -> httpx.Timeout:
        c = self.config
        return httpx.Timeout(c.first_token_timeout_s, connect=c.connect_timeout_s)

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        pool = self.choose_pool(ctx)
        body = self._body(request, stream=False)
        errors: list[str] = []
        for replica in await self.ranked_replicas(pool):
            replica.in_flight += 1
            try:
                resp = await self._client.post(
                    f"{replica.url}/v1/chat/completions", json=body, timeout=self._timeout()
                )
            except httpx.TimeoutException as exc:
                raise ProviderTimeout(
                    f"{replica.url}: no response in time ({exc!r})", provider=self.name
                ) from exc
            except httpx.TransportError as exc:
                self._mark_down(replica, errors, f"{replica.url}: {exc!r}")
                continue
            finally:
                replica.in_flight = max(0, replica.in_flight - 1)
            if resp.status_code >= 500:
                self._mark_down(
                    replica, errors, f"{replica.url}: HTTP {resp.status_code} {_error_message(resp)}"
                )
                continue
            if resp.status_code != 200:
                raise _http_error(resp, self.name)
            return self._result(resp, pool, ctx)
        raise ProviderUnavailable(
            f"no replica of pool {pool!r} served: {'; '.join(errors)}", provider=self.name
        )

    def _mark_down(self, replica: Replica, errors: list[str], why: str) -> None:
        replica.down_until = time.monotonic() + self.config.down_for_s
        errors.append(why)
        logger.warning("%s: replica failed before the first token, trying the next: %s", self.name, why)

    def _result(self, resp: httpx.Response, pool: str, ctx: CallContext) -> ChatResult:
        try:
            data = resp.json()
        except ValueError as exc:
            raise ProviderBadResponse(
                f"SGLang answered 200 with a body that is not JSON: {exc}", provider=self.name
            ) from None
        body = wire.read_response(data, self.name)
        choice = body.choices[0]
        finish = choice.finish_reason or "stop"
        if finish == "abort":  # the server dropped the request; nothing usable came back
            raise ProviderUnavailable("SGLang aborted the request", provider=self.name)
        usage = body.usage.usage() if body.usage else Usage()
        tool_calls = wire.tool_calls_of(choice.message, self.name)
        outcome = self._speculation(_spec_details(body.sglext, choice.meta_info), pool, ctx, usage)
        result = ChatResult.single(
            id=body.id,
            model=body.model or self.config.model,
            # SGLang sends content "" beside tool calls (serving_chat.py: "content should not be
            # None but empty string"); OpenAI's shape has null there
            content=choice.message.content or (None if tool_calls else ""),
            tool_calls=tool_calls,
            finish_reason=wire.finish_reason(finish, bool(tool_calls)),
            usage=usage,
            speculation=SpeculationInfo.from_outcome(outcome),
            provider=self.name,
        )
        return result.attach_outcome(outcome)

    def _speculation(
        self, spec: wire.WireSpecDetails | None, pool: str, ctx: CallContext, usage: Usage
    ) -> SpeculationOutcome:
        """The outcome from SGLang 0.5.23's per-request counters (tokenizer_manager.py
        `_calculate_spec_decoding_metrics`): `spec_verify_ct` verify passes,
        `spec_num_correct_drafts` accepted drafts, `spec_correct_drafts_histogram[k]` passes that
        accepted k drafts (as long as the largest k seen + 1), `spec_accept_length` completion
        tokens per pass, and `spec_num_proposed_drafts` = verify_ct × (launch num_draft_tokens − 1).
        On an adaptive pool a pass drafts 0..max steps, so that last figure is not what was
        proposed: the outcome says `gamma_varies` and the policy takes α from the histogram."""
        cfg = self.config.pools[pool]
        decision = ctx.decision
        gamma = cfg.gamma_for(decision)
        figures: dict[str, Any] = {}
        if cfg.method != "off" and spec is not None and spec.spec_verify_ct > 0:
            verify_ct = spec.spec_verify_ct
            hist = list(spec.spec_correct_drafts_histogram)
            if hist and gamma and len(hist) < gamma + 1:
                hist += [0] * (gamma + 1 - len(hist))  # SGLang grows it only as far as seen
            completion = usage.completion_tokens
            figures = {
                "target_passes": verify_ct,
                "accepted": spec.spec_num_correct_drafts,
                "proposed": spec.spec_num_proposed_drafts,
                "accept_length_histogram": tuple(hist),
                "tokens_per_pass": spec.spec_accept_length or (completion / verify_ct),
                "gamma_varies": cfg.adaptive,
            }
        return SpeculationOutcome(
            method=cfg.method,
            gamma=gamma,
            completion_tokens=usage.completion_tokens,
            rule=decision.rule if decision is not None else None,
            policy_version=decision.policy_version if decision is not None else None,
            pool=pool,
            **figures,
        )

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        return chat_stream(self._stream(request, ctx))

    async def _stream(self, request: ChatRequest, ctx: CallContext) -> AsyncGenerator[ChatChunk, None]:
        pool = self.choose_pool(ctx)
        body = self._body(request, stream=True)
        errors: list[str] = []
        for replica in await self.ranked_replicas(pool):
            replica.in_flight += 1
            try:
                async with self._client.stream(
                    "POST", f"{replica.url}/v1/chat/completions", json=body, timeout=self._timeout()
                ) as resp:
                    if resp.status_code >= 500:
                        await resp.aread()
                        self._mark_down(
                            replica, errors, f"{replica.url}: HTTP {resp.status_code} {_error_message(resp)}"
                        )
                        continue
                    if resp.status_code != 200:
                        await resp.aread()
                        raise _http_error(resp, self.name)
                    async with aclosing(self._chunks(resp, pool, ctx)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
            except httpx.TimeoutException as exc:
                raise ProviderTimeout(
                    f"{replica.url}: no first token in time ({exc!r})", provider=self.name
                ) from exc
            except httpx.TransportError as exc:
                self._mark_down(replica, errors, f"{replica.url}: {exc!r}")
                continue
            finally:
                replica.in_flight = max(0, replica.in_flight - 1)
        raise ProviderUnavailable(
            f"no replica of pool {pool!r} served: {'; '.join(errors)}", provider=self.name
        )

    async def _chunks(self, resp: httpx.Response, pool: str, ctx: CallContext) -> AsyncIterator[ChatChunk]:
        """SSE events -> ChatChunks. Errors after the first yielded chunk become StreamBroken."""
        acc = wire.ChunkAccumulator(self.config.model)
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # comments, `event:` lines (SGLang's framed `sglext_ids`), blanks
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if isinstance(data, dict) and "error" in data:
                    err = _error_from_body(data["error"], self.name)
                    if acc.started:
                        raise StreamBroken(f"SGLang stream error: {err.message}", provider=self.name)
                    raise err
                for chunk in acc.feed(wire.read_chunk(data, self.name)):
                    yield chunk
        except httpx.TimeoutException as exc:
            if acc.started:
                raise StreamBroken(f"SGLang stream stalled: {exc!r}", provider=self.name) from exc
            raise ProviderTimeout(f"no first token in time: {exc!r}", provider=self.name) from exc
        except httpx.TransportError as exc:
            if acc.started:
                raise StreamBroken(f"SGLang stream broke: {exc!r}", provider=self.name) from exc
            raise ProviderUnavailable(
                f"SGLang stream failed before the first token: {exc!r}", provider=self.name
            ) from exc
        except (json.JSONDecodeError, ProviderBadResponse) as exc:
            if acc.started:
                raise StreamBroken(f"SGLang stream unreadable: {exc}", provider=self.name) from exc
            if isinstance(exc, ProviderBadResponse):
                raise
            raise ProviderBadResponse(f"SGLang stream event is not JSON: {exc}", provider=self.name) from exc
        if acc.finish is None:
            if acc.started:
                raise StreamBroken("SGLang stream ended without a finish_reason", provider=self.name)
            raise ProviderUnavailable("SGLang stream ended before any token", provider=self.name)
        if acc.finish == "abort":
            if acc.started:
                raise StreamBroken("SGLang aborted the request mid-stream", provider=self.name)
            raise ProviderUnavailable("SGLang aborted the request", provider=self.name)
        usage = acc.usage or Usage()
        outcome = self._speculation(_spec_details(acc.sglext, None), pool, ctx, usage)
        yield acc.final(SpeculationInfo.from_outcome(outcome), self.name).attach_outcome(outcome)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


# ---------------------------------------------------------------- helpers


def _spec_details(
    sglext: wire.WireSglExt | None, meta_info: dict[str, Any] | None
) -> wire.WireSpecDetails | None:
    """The speculation counters: `sglext.spec_tokens_details` (asked for), else the same names in
    a choice's `meta_info` (present when a caller set `return_meta_info`)."""
    spec = sglext.spec() if sglext is not None else None
    if spec is None and meta_info and meta_info.get("spec_verify_ct"):
        try:
            spec = wire.WireSpecDetails.model_validate(meta_info)
        except ValueError:
            spec = None
    return spec


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(data, dict):
        inner = data.get("error") if isinstance(data.get("error"), dict) else data
        return str(inner.get("message") or inner.get("detail") or data)[:500]
    return str(data)[:200]


def _http_error(resp: httpx.Response, provider: str) -> ProviderError:
    message = _error_message(resp)
    code = resp.status_code
    if code == 429:
        return ProviderRateLimited(
            message, provider=provider, status_code=code, retry_after=wire.retry_after(resp.headers)
        )
    if code in (408, 504):
        return ProviderTimeout(message, provider=provider, status_code=code)
    if code >= 500:
        return ProviderUnavailable(message, provider=provider, status_code=code)
    return ProviderBadRequest(message, provider=provider, status_code=code)


def _error_from_body(err: Any, provider: str) -> ProviderError:
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
    return ProviderBadRequest(message, provider=provider, status_code=code)

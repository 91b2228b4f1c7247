"""SGLang provider: self-hosted SGLang servers grouped into pools, one speculation setting per pool.

SGLang fixes speculation per server at launch (`--speculative-algorithm EAGLE3|NGRAM`, ...), so the
runner realises a policy by routing: the Decision's `pool` (or, failing that, the pool whose method
matches the Decision's method, or the default pool) picks the pool; inside it the least-loaded
replica serves. Replica load comes from the server itself, cached for `load_cache_s`:
  GET /v1/loads?include=core   -> {"loads": [{"dp_rank", "num_running_reqs", "num_waiting_reqs", ...}]}
  GET /get_load                -> [{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}] (0.5.x, deprecated later)
  GET /metrics                 -> Prometheus `sglang:num_running_reqs`, `sglang:num_queue_reqs`
the first that answers is remembered per replica.

Requests go to `/v1/chat/completions` (OpenAI-compatible). Non-streaming requests ask for
`return_meta_info`, whose per-choice `meta_info` carries the speculation counters (`spec_verify_ct`,
`spec_accept_length`, `spec_accept_rate`, and the accepted/proposed draft counts under the names
SGLang versions have used). SGLang errors are `{"object": "error", "message", "type", "param",
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
from openalice_runner.providers.admission import AdmissionLimits
from openalice_runner.providers.base import (
    CallContext,
    Capabilities,
    Provider,
    ProviderBadRequest,
    ProviderError,
    ProviderLoad,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.redaction import register_secret
from openalice_runner.speculation import SpecMethod, SpeculationOutcome
from openalice_runner.types import (
    ChatChunk,
    ChatRequest,
    ChatResult,
    ChunkChoice,
    FunctionCallDelta,
    SpeculationInfo,
    ToolCall,
    ToolCallDelta,
    Usage,
    new_id,
)

logger = logging.getLogger(__name__)

_ALGORITHM = {"eagle": "EAGLE3", "ngram": "NGRAM", "draft": "STANDALONE"}


# ---------------------------------------------------------------- config


class SGLangLaunch(StrictModel):
    """The speculation flags a pool's servers were (or should be) launched with."""

    num_steps: int | None = Field(default=None, ge=1)  # --speculative-num-steps
    eagle_topk: int | None = Field(default=None, ge=1)  # --speculative-eagle-topk
    num_draft_tokens: int | None = Field(default=None, ge=2)  # --speculative-num-draft-tokens
    draft_model_path: str | None = None  # --speculative-draft-model-path
    adaptive_config: str | None = None  # --speculative-adaptive-config


class SGLangPool(StrictModel):
    replicas: list[str] = Field(min_length=1)  # base URLs, e.g. http://10.0.0.5:30000
    method: SpecMethod = "off"
    launch: SGLangLaunch = Field(default_factory=SGLangLaunch)

    @field_validator("replicas")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica {url!r} must be an http(s) URL")
        return [u.rstrip("/") for u in v]

    @property
    def gamma(self) -> int:
        """Draft tokens per verify round (SGLang counts the target's own token in num_draft_tokens)."""
        if self.method == "off":
            return 0
        if self.launch.num_draft_tokens:
            return self.launch.num_draft_tokens - 1
        return self.launch.num_steps or 0

    def launch_args(self) -> list[str]:
        """`sglang.launch_server` flags that realise this pool's speculation setting."""
        if self.method == "off":
            return []
        args = ["--speculative-algorithm", _ALGORITHM[self.method]]
        launch = self.launch
        for flag, value in (
            ("--speculative-draft-model-path", launch.draft_model_path),
            ("--speculative-num-steps", launch.num_steps),
            ("--speculative-eagle-topk", launch.eagle_topk),
            ("--speculative-num-draft-tokens", launch.num_draft_tokens),
            ("--speculative-adaptive-config", launch.adaptive_config),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args


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
    order = ["v1_loads", "get_load", "metrics"]
    if replica.load_endpoint:
        order.remove(replica.load_endpoint)
        order.insert(0, replica.load_endpoint)
    for endpoint in order:
        try:
            figures = await _LOAD_READERS[endpoint](client, replica.url, timeout)
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            figures = None
        if figures is not None:
            replica.running, replica.waiting = figures
            replica.load_endpoint = endpoint
            replica.read_at = time.monotonic()
            replica.in_flight = 0
            return
    replica.running = replica.waiting = None
    replica.read_at = time.monotonic()


async def _read_v1_loads(client: httpx.AsyncClient, url: str, timeout: float) -> tuple[int, int] | None:
    resp = await client.get(f"{url}/v1/loads", params={"include": "core"}, timeout=timeout)
    if resp.status_code != 200:
        return None
    loads = resp.json()["loads"]
    return (
        sum(int(x.get("num_running_reqs") or 0) for x in loads),
        sum(int(x.get("num_waiting_reqs") or 0) for x in loads),
    )


async def _read_get_load(client: httpx.AsyncClient, url: str, timeout: float) -> tuple[int, int] | None:
    resp = await client.get(f"{url}/get_load", timeout=timeout)
    if resp.status_code != 200:
        return None
    data = resp.json()
    ranks = data if isinstance(data, list) else [data]
    return (
        sum(int(x.get("num_reqs") or 0) for x in ranks),
        sum(int(x.get("num_waiting_reqs") or 0) for x in ranks),
    )


async def _read_metrics(client: httpx.AsyncClient, url: str, timeout: float) -> tuple[int, int] | None:
    resp = await client.get(f"{url}/metrics", timeout=timeout)
    if resp.status_code != 200:
        return None
    running = parse_prometheus_sum(resp.text, "sglang:num_running_reqs")
    if running is None:
        return None
    return int(running), int(parse_prometheus_sum(resp.text, "sglang:num_queue_reqs") or 0)


_LOAD_READERS = {"v1_loads": _read_v1_loads, "get_load": _read_get_load, "metrics": _read_metrics}


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
        return ProviderLoad(batch_size=best.running + best.in_flight, queue_depth=best.waiting)

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
        body: dict[str, Any] = {"model": self.config.model, "messages": request.message_dicts()}
        if request.tools:
            body["tools"] = request.tool_dicts()
        if request.tool_choice is not None:
            choice = request.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        for field in ("temperature", "top_p", "top_k", "seed", "stop", "max_tokens"):
            value = getattr(request, field)
            if value is not None:
                body[field] = value
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        else:
            body["return_meta_info"] = True  # per-request speculation counters
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
            return self._result(resp.json(), pool, ctx)
        raise ProviderUnavailable(
            f"no replica of pool {pool!r} served: {'; '.join(errors)}", provider=self.name
        )

    def _mark_down(self, replica: Replica, errors: list[str], why: str) -> None:
        replica.down_until = time.monotonic() + self.config.down_for_s
        errors.append(why)
        logger.warning("%s: replica failed before the first token, trying the next: %s", self.name, why)

    def _result(self, data: dict[str, Any], pool: str, ctx: CallContext) -> ChatResult:
        try:
            choice = data["choices"][0]
            message = choice["message"]
            finish = choice.get("finish_reason") or "stop"
        except (KeyError, IndexError, TypeError) as exc:
            raise ProviderUnavailable(f"malformed response from SGLang: {exc!r}", provider=self.name) from exc
        if finish == "abort":  # the server dropped the request; nothing usable came back
            raise ProviderUnavailable("SGLang aborted the request", provider=self.name)
        usage_data = data.get("usage") or {}
        usage = Usage.of(
            int(usage_data.get("prompt_tokens") or 0), int(usage_data.get("completion_tokens") or 0)
        )
        tool_calls = [ToolCall.model_validate(tc) for tc in message.get("tool_calls") or []] or None
        outcome = self._speculation(choice.get("meta_info"), pool, ctx, usage)
        result = ChatResult.single(
            id=data.get("id"),
            model=data.get("model") or self.config.model,
            content=message.get("content"),
            tool_calls=tool_calls,
            finish_reason=_finish_reason(finish, tool_calls),
            usage=usage,
            speculation=SpeculationInfo.from_outcome(outcome),
            provider=self.name,
        )
        return result.attach_outcome(outcome)

    def _speculation(
        self, meta: dict[str, Any] | None, pool: str, ctx: CallContext, usage: Usage
    ) -> SpeculationOutcome:
        cfg = self.config.pools[pool]
        decision = ctx.decision
        figures: dict[str, Any] = {}
        meta = meta or {}
        verify_ct = meta.get("spec_verify_ct")
        if cfg.method != "off" and verify_ct:
            accepted = _first_int(meta, "spec_accepted_drafts", "spec_num_correct_drafts", "spec_accept_token_num")
            proposed = _first_int(
                meta, "spec_proposed_drafts", "spec_num_proposed_drafts", "spec_draft_token_num"
            )
            if proposed is None and cfg.gamma:
                proposed = int(verify_ct) * cfg.gamma
            length = meta.get("spec_accept_length")
            completion = int(meta.get("completion_tokens") or usage.completion_tokens)
            figures = {
                "target_passes": int(verify_ct),
                "accepted": accepted or 0,
                "proposed": proposed or 0,
                "tokens_per_pass": float(length) if length is not None else completion / int(verify_ct),
            }
        return SpeculationOutcome(
            method=cfg.method,
            gamma=cfg.gamma,
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
        started = False
        chunk_id = new_id("chatcmpl")
        model = self.config.model
        finish: str | None = None
        usage: Usage | None = None
        saw_tool_calls = False
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    err = _error_from_body(data["error"], self.name)
                    if started:
                        raise StreamBroken(f"SGLang stream error: {err.message}", provider=self.name)
                    raise err
                chunk_id = data.get("id") or chunk_id
                model = data.get("model") or model
                if data.get("usage"):
                    u = data["usage"]
                    usage = Usage.of(int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0))
                for choice in data.get("choices") or []:
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                    delta = choice.get("delta") or {}
                    content = delta.get("content")
                    calls = delta.get("tool_calls")
                    if not content and not calls:
                        continue  # role-only opener or finish marker: not a token
                    saw_tool_calls = saw_tool_calls or bool(calls)
                    yield ChatChunk.piece(
                        chunk_id, model, content or None,
                        [_tool_call_delta(tc) for tc in calls] if calls else None, first=not started,
                    )
                    started = True
        except httpx.TimeoutException as exc:
            if started:
                raise StreamBroken(f"SGLang stream stalled: {exc!r}", provider=self.name) from exc
            raise ProviderTimeout(f"no first token in time: {exc!r}", provider=self.name) from exc
        except (httpx.TransportError, json.JSONDecodeError) as exc:
            if started:
                raise StreamBroken(f"SGLang stream broke: {exc!r}", provider=self.name) from exc
            raise ProviderUnavailable(
                f"SGLang stream failed before the first token: {exc!r}", provider=self.name
            ) from exc
        if finish is None:
            if started:
                raise StreamBroken("SGLang stream ended without a finish_reason", provider=self.name)
            raise ProviderUnavailable("SGLang stream ended before any token", provider=self.name)
        if finish == "abort":
            if started:
                raise StreamBroken("SGLang aborted the request mid-stream", provider=self.name)
            raise ProviderUnavailable("SGLang aborted the request", provider=self.name)
        usage = usage or Usage()
        outcome = self._speculation(None, pool, ctx, usage)
        final = ChatChunk(
            id=chunk_id,
            model=model,
            choices=[ChunkChoice(finish_reason=_finish_reason(finish, [1] if saw_tool_calls else None))],
            usage=usage,
            speculation=SpeculationInfo.from_outcome(outcome),
            provider=self.name,
        )
        yield final.attach_outcome(outcome)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


# ---------------------------------------------------------------- helpers


def _first_int(meta: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        if meta.get(key) is not None:
            return int(meta[key])
    return None


def _finish_reason(finish: str, tool_calls: Any) -> Any:
    if tool_calls and finish in ("stop", "tool_calls"):
        return "tool_calls"
    if finish in ("stop", "length", "tool_calls", "content_filter"):
        return finish
    return "stop"


def _tool_call_delta(tc: dict[str, Any]) -> ToolCallDelta:
    fn = tc.get("function") or {}
    return ToolCallDelta(
        index=int(tc.get("index") or 0),
        id=tc.get("id"),
        type="function" if tc.get("id") else None,
        function=FunctionCallDelta(name=fn.get("name"), arguments=fn.get("arguments")),
    )


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(data, dict):
        inner = data.get("error") if isinstance(data.get("error"), dict) else data
        return str(inner.get("message") or inner.get("detail") or data)[:500]
    return str(data)[:200]


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _http_error(resp: httpx.Response, provider: str) -> ProviderError:
    message = _error_message(resp)
    code = resp.status_code
    if code == 429:
        return ProviderRateLimited(
            message, provider=provider, status_code=code, retry_after=_retry_after(resp)
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

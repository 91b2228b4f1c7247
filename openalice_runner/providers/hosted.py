"""Hosted provider: any model litellm knows (OpenAI, Anthropic, Gemini, an OpenAI-compatible URL...).

Calls `litellm.acompletion` per request with everything passed as arguments: no global litellm
callback, setting or env mutation beyond one `setdefault` (below), so the host application keeps
control of litellm. The API key is read from the environment variable the config names, at call
time. Retries on rate limits (honouring Retry-After, capped) and on timeouts before the first
token are done here, with litellm's and the OpenAI SDK's own retries switched off so the count is
ours. litellm's exceptions become the runner's error types.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, Literal

from pydantic import ConfigDict, Field

from openalice_runner.providers import openai_wire as wire
from openalice_runner.providers.base import (
    CallContext,
    Capabilities,
    Provider,
    ProviderBadRequest,
    ProviderBadResponse,
    ProviderError,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    StreamBroken,
)
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.admission import AdmissionLimits
from openalice_runner.redaction import register_secret
from openalice_runner.types import (
    ChatChunk,
    ChatRequest,
    ChatResult,
    SpeculationInfo,
)

logger = logging.getLogger(__name__)


class HostedConfig(AdmissionLimits):  # max_in_flight / max_queue: the gate in front of it
    model_config = ConfigDict(extra="forbid")

    type: Literal["hosted"]
    model: str  # litellm model string, e.g. "openai/gpt-4o-mini", "anthropic/claude-3-5-haiku-latest"
    api_key_env: str | None = None  # env var holding the key; None lets litellm use its usual env var
    api_base: str | None = None  # for OpenAI-compatible servers
    timeout_s: float = Field(default=60.0, gt=0)  # whole request (non-streaming)
    first_token_timeout_s: float = Field(default=30.0, gt=0)  # streaming: until the first chunk
    max_retries: int = Field(default=2, ge=0, le=10)  # on 429 and timeouts, before the first token
    retry_backoff_s: float = Field(default=0.5, ge=0)
    max_retry_wait_s: float = Field(default=10.0, ge=0)  # cap on Retry-After / backoff
    extra_headers: dict[str, str] | None = None


_litellm = None


def _import_litellm():
    """Imported on first use: litellm takes seconds to import and most runs never need it."""
    global _litellm
    if _litellm is None:
        # Without this, importing litellm fetches a price map from the internet (and retries for
        # seconds when offline). setdefault: an application that wants the remote map still gets it.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import litellm

        _litellm = litellm
    return _litellm


class HostedProvider(Provider):
    kind = "hosted"

    def __init__(self, name: str, config: HostedConfig) -> None:
        self.name = name
        self.config = config
        self.capabilities = Capabilities(tools=True, streaming=True, spec_methods=frozenset({"off"}))
        self.gen_ai_provider_name = config.model.split("/", 1)[0] if "/" in config.model else "openai"
        if config.api_key_env and not os.environ.get(config.api_key_env):
            # Checked again per call; warn early so a misconfiguration shows at startup.
            logger.warning("provider %s: environment variable %s is not set", name, config.api_key_env)

    @property
    def model_names(self) -> list[str]:
        return [self.config.model]

    def _kwargs(self, request: ChatRequest, stream: bool) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = {
            "num_retries": 0,  # retries are ours (see module docstring)
            "max_retries": 0,
        }
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ProviderUnavailable(
                    f"environment variable {cfg.api_key_env} (API key) is not set", provider=self.name
                )
            register_secret(key)  # upstream errors may echo it: kept out of what we report
            kwargs["api_key"] = key
        if cfg.api_base:
            kwargs["api_base"] = cfg.api_base
        if cfg.extra_headers:
            kwargs["extra_headers"] = dict(cfg.extra_headers)
        # messages, tools, tool_choice, parallel_tool_calls, sampling fields; top_k is no OpenAI
        # param: litellm refuses it where the upstream does not take it
        kwargs.update(wire.request_body(request, cfg.model))
        if stream:
            kwargs["stream"] = True
            kwargs["stream_options"] = {"include_usage": True}
            kwargs["timeout"] = cfg.timeout_s
        else:
            kwargs["timeout"] = cfg.timeout_s
        return kwargs

    async def _with_retries(self, attempt):
        """Run `attempt()` and retry it on 429 / timeout, which only happen before the first token."""
        tries = 0
        while True:
            try:
                return await attempt()
            except (ProviderRateLimited, ProviderTimeout) as exc:
                if tries >= self.config.max_retries:
                    raise
                wait = self._retry_wait(exc, tries)
                tries += 1
                logger.info("%s: %s; retry %d in %.2fs", self.name, exc, tries, wait)
                await asyncio.sleep(wait)

    def _retry_wait(self, exc: ProviderError, tries: int) -> float:
        if exc.retry_after is not None:
            return min(self.config.max_retry_wait_s, exc.retry_after)
        backoff = self.config.retry_backoff_s * (2**tries)
        return min(self.config.max_retry_wait_s, backoff * (0.5 + random.random() / 2))

    # ---- chat ----

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        kwargs = self._kwargs(request, stream=False)
        litellm = _import_litellm()

        async def attempt():
            try:
                return await litellm.acompletion(**kwargs)
            except Exception as exc:
                raise map_litellm_error(exc, self.name) from exc

        response = await self._with_retries(attempt)
        return self._result(response)

    def _result(self, response: Any) -> ChatResult:
        body = wire.read_response(response, self.name)
        choice = body.choices[0]
        tool_calls = wire.tool_calls_of(choice.message, self.name, choice.finish_reason)
        return ChatResult.single(
            id=body.id,
            model=body.model or self.config.model,
            content=choice.message.content,
            tool_calls=tool_calls,
            finish_reason=wire.finish_reason(choice.finish_reason, bool(tool_calls), self.name),
            usage=wire.usage_of(body.usage),  # None where upstream sent none: unknown
            speculation=SpeculationInfo(method="off"),
            provider=self.name,
        )

    # ---- stream ----

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        return chat_stream(self._stream(request, ctx))

    async def _stream(self, request: ChatRequest, ctx: CallContext) -> AsyncGenerator[ChatChunk, None]:
        kwargs = self._kwargs(request, stream=True)
        litellm = _import_litellm()

        async def open_stream():
            """Start the stream and wait for its first chunk, so that retries cover both."""
            try:
                stream = await asyncio.wait_for(
                    litellm.acompletion(**kwargs), timeout=self.config.first_token_timeout_s
                )
                try:
                    first = await asyncio.wait_for(anext(stream), timeout=self.config.first_token_timeout_s)
                except BaseException:
                    await stream.aclose()  # the retry opens a new response; this one is let go now
                    raise
            except TimeoutError as exc:
                raise ProviderTimeout(
                    f"no first chunk within {self.config.first_token_timeout_s}s", provider=self.name
                ) from exc
            except StopAsyncIteration:
                return None, None
            except Exception as exc:
                raise map_litellm_error(exc, self.name) from exc
            return stream, first

        stream, first = await self._with_retries(open_stream)
        if stream is None:
            raise ProviderUnavailable("stream ended before any chunk", provider=self.name)
        try:
            async with aclosing(self._chunks(stream, first)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            await stream.aclose()  # closes the HTTP response, whoever stops reading

    async def _chunks(self, stream: Any, first: Any) -> AsyncGenerator[ChatChunk, None]:
        """litellm's chunks (the first one already read) -> ChatChunks."""
        acc = wire.ChunkAccumulator(self.config.model, self.name)
        pending = first
        while True:
            if pending is None:
                try:
                    pending = await anext(stream)
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    err = map_litellm_error(exc, self.name)
                    if acc.started:
                        raise StreamBroken(f"stream broke: {err.message}", provider=self.name) from exc
                    raise err from exc
            raw, pending = pending, None
            try:
                pieces = acc.feed(wire.read_chunk(raw, self.name))
            except ProviderBadResponse as exc:
                if acc.started:
                    raise StreamBroken(f"stream unreadable: {exc.message}", provider=self.name) from exc
                raise
            for piece in pieces:
                yield piece
        if acc.finish is None and not acc.started:
            raise ProviderUnavailable("stream ended before any token", provider=self.name)
        yield acc.final(SpeculationInfo(method="off"), self.name)


# ---------------------------------------------------------------- error mapping


def map_litellm_error(exc: BaseException, provider: str) -> ProviderError:
    """litellm (OpenAI-SDK style) exception -> runner error type."""
    if isinstance(exc, ProviderError):
        return exc
    litellm = _import_litellm()
    message = str(getattr(exc, "message", None) or exc)
    status = getattr(exc, "status_code", None)
    status = status if isinstance(status, int) else None
    if isinstance(exc, (litellm.exceptions.Timeout, TimeoutError)):
        return ProviderTimeout(message, provider=provider, status_code=status)
    if isinstance(exc, litellm.exceptions.RateLimitError) or status == 429:
        return ProviderRateLimited(message, provider=provider, status_code=429, retry_after=_retry_after(exc))
    if isinstance(exc, litellm.exceptions.APIConnectionError) and (status is None or status >= 500):
        return ProviderUnavailable(message, provider=provider, status_code=status)
    if status is not None and status >= 500:
        return ProviderUnavailable(message, provider=provider, status_code=status)
    if status is not None and 400 <= status < 500:
        return ProviderBadRequest(message, provider=provider, status_code=status)
    if isinstance(exc, litellm.exceptions.APIError | litellm.exceptions.ServiceUnavailableError):
        return ProviderUnavailable(message, provider=provider, status_code=status)
    return ProviderError(f"{type(exc).__name__}: {message}", provider=provider, status_code=status)


def _retry_after(exc: BaseException) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None) if response is not None else None
    return wire.retry_after(headers or getattr(exc, "litellm_response_headers", None))

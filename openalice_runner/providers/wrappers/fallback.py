"""FallbackProvider: try a chain of providers in order, moving on only before the first token.

A failure that allows fallback (connection refused, 5xx, timeout, 429: `ProviderError.fallback_ok`)
before anything was produced sends the request to the next provider; the result names the one
that served (`provider`) and those that failed first (`fallback_from`). Once a stream has yielded
its first chunk, a failure is raised as `StreamBroken` and nothing is retried: the caller already
holds part of an answer and a silent restart would duplicate or contradict it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

from openalice_runner.providers.base import (
    CallContext,
    NoProviderAvailable,
    Provider,
    ProviderError,
    StreamBroken,
)
from openalice_runner.providers.streams import ChatStream, chat_stream
from openalice_runner.providers.wrappers.wrapper import WrapperProvider
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult

logger = logging.getLogger(__name__)


class FallbackProvider(WrapperProvider):
    """Wraps the first provider of the chain (its name, load and capabilities stand for the chain)."""

    def __init__(self, chain: Sequence[Provider]) -> None:
        if not chain:
            raise ValueError("a fallback chain needs at least one provider")
        super().__init__(chain[0])
        self.chain = list(chain)

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        errors: list[ProviderError] = []
        for provider in self.chain:
            try:
                result = await provider.chat(request, ctx)
            except ProviderError as exc:
                if not exc.fallback_ok:
                    raise
                self._note_failure(provider, exc, errors)
                continue
            return _mark_served(result, provider, errors)
        raise _exhausted(errors)

    @asynccontextmanager
    async def stream(self, request: ChatRequest, ctx: CallContext) -> AsyncIterator[ChatStream]:
        errors: list[ProviderError] = []
        for provider in self.chain:
            async with AsyncExitStack() as attempt:  # a failed attempt's stream is closed before the next
                try:
                    chunks = await attempt.enter_async_context(provider.stream(request, ctx))
                    first = await anext(chunks, None)  # None: an empty stream is an answer, not a failure
                except ProviderError as exc:
                    if not exc.fallback_ok:
                        raise
                    self._note_failure(provider, exc, errors)
                    continue
                # From here on tokens are out: no fallback, only a typed report of the break.
                async with chat_stream(self._served(first, chunks, provider, errors)) as out:
                    yield out
                return
        raise _exhausted(errors)

    @staticmethod
    async def _served(
        first: ChatChunk | None, chunks: ChatStream, provider: Provider, errors: list[ProviderError]
    ) -> AsyncGenerator[ChatChunk, None]:
        if first is None:
            return
        yield _mark_served(first, provider, errors)
        try:
            async for chunk in chunks:
                yield _mark_served(chunk, provider, errors) if chunk.finish_reason else chunk
        except StreamBroken:
            raise
        except ProviderError as exc:
            raise StreamBroken(
                f"stream broke after the first token: {exc.message}",
                provider=provider.name,
                status_code=exc.status_code,
            ) from exc

    @staticmethod
    def _note_failure(provider: Provider, exc: ProviderError, errors: list[ProviderError]) -> None:
        if exc.provider is None:
            exc.provider = provider.name
        errors.append(exc)
        logger.warning("provider %s failed before the first token, falling back: %s", provider.name, exc)

    async def aclose(self) -> None:
        for provider in self.chain:
            await provider.aclose()


def _mark_served(item, provider: Provider, errors: list[ProviderError]):
    if item.provider is None:
        item.provider = provider.name
    if errors:
        item.fallback_from = [e.provider or "?" for e in errors]
    return item


def _exhausted(errors: list[ProviderError]) -> NoProviderAvailable:
    detail = "; ".join(str(e) for e in errors)
    last = errors[-1] if errors else None
    return NoProviderAvailable(
        f"every provider failed before the first token: {detail}",
        errors=errors,
        status_code=last.status_code if last else None,
        retry_after=last.retry_after if last else None,
    )


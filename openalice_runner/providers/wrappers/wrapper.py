"""WrapperProvider: a provider that delegates the Provider interface to the one it wraps.

Subclasses (fallback, tracing) override only what they add; the rest of the interface passes through.
Nothing else does: what only one kind of provider has (EmbeddedProvider.engine) is reached through
`unwrap()`, so a wrapper never answers for attributes it does not know.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from openalice_runner.providers.base import CallContext, Capabilities, Provider, ProviderLoad
from openalice_runner.providers.streams import ChatStream
from openalice_runner.types import ChatRequest, ChatResult


class WrapperProvider(Provider):
    # name, kind, ...: Provider's plain attributes, read here from the wrapped provider; mypy holds
    # a read-only property over a writable attribute against it, hence the ignores below
    def __init__(self, wrapped: Provider) -> None:
        self.wrapped = wrapped

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.wrapped.name

    @property
    def kind(self) -> str:  # type: ignore[override]
        return self.wrapped.kind

    @property
    def gen_ai_provider_name(self) -> str:  # type: ignore[override]
        return self.wrapped.gen_ai_provider_name

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return self.wrapped.capabilities

    @property
    def model_names(self) -> list[str]:
        return self.wrapped.model_names

    async def chat(self, request: ChatRequest, ctx: CallContext) -> ChatResult:
        return await self.wrapped.chat(request, ctx)

    def stream(self, request: ChatRequest, ctx: CallContext) -> AbstractAsyncContextManager[ChatStream]:
        return self.wrapped.stream(request, ctx)

    def precheck(self, request: ChatRequest) -> None:
        self.wrapped.precheck(request)

    def load(self) -> ProviderLoad:
        return self.wrapped.load()

    async def current_load(self) -> ProviderLoad:
        return await self.wrapped.current_load()

    def pool_load(self, pool: str) -> ProviderLoad | None:
        return self.wrapped.pool_load(pool)

    async def ensure_loaded(self) -> None:
        await self.wrapped.ensure_loaded()

    @property
    def kv_tokens_in_use(self) -> int | None:
        return self.wrapped.kv_tokens_in_use

    async def aclose(self) -> None:
        await self.wrapped.aclose()

    def unwrap(self) -> Provider:
        """The provider at the bottom of the wrapping."""
        inner: Provider = self.wrapped
        while isinstance(inner, WrapperProvider):
            inner = inner.wrapped
        return inner

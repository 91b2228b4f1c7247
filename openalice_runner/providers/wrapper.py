"""WrapperProvider: a provider that delegates everything to the one it wraps.

Subclasses (fallback, tracing) override only what they add; everything else passes through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from openalice_runner.providers.base import CallContext, Capabilities, Provider, ProviderLoad
from openalice_runner.types import ChatChunk, ChatRequest, ChatResult


class WrapperProvider(Provider):
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

    def stream(self, request: ChatRequest, ctx: CallContext) -> AsyncIterator[ChatChunk]:
        return self.wrapped.stream(request, ctx)

    def precheck(self, request: ChatRequest) -> None:
        self.wrapped.precheck(request)

    def load(self) -> ProviderLoad:
        return self.wrapped.load()

    async def current_load(self) -> ProviderLoad:
        return await self.wrapped.current_load()

    async def aclose(self) -> None:
        await self.wrapped.aclose()

    def __getattr__(self, name: str) -> Any:
        # Provider-specific extras (e.g. LocalProvider.engine) stay reachable through wrappers.
        if name == "wrapped":
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def unwrap(self) -> Provider:
        inner: Provider = self.wrapped
        while isinstance(inner, WrapperProvider):
            inner = inner.wrapped
        return inner

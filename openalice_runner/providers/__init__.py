"""Providers: where a chat request runs (embedded engine, SGLang pools, hosted APIs), composed by wrapping."""

from __future__ import annotations

from openalice_runner.providers.base import (
    CallContext,
    Capabilities,
    NoProviderAvailable,
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
from openalice_runner.providers.streams import ChatStream
from openalice_runner.providers.wrappers.fallback import FallbackProvider
from openalice_runner.providers.wrappers.wrapper import WrapperProvider

__all__ = [
    "CallContext",
    "Capabilities",
    "ChatStream",
    "FallbackProvider",
    "NoProviderAvailable",
    "Provider",
    "ProviderBadRequest",
    "ProviderBadResponse",
    "ProviderError",
    "ProviderLoad",
    "ProviderRateLimited",
    "ProviderTimeout",
    "ProviderUnavailable",
    "StreamBroken",
    "WrapperProvider",
]

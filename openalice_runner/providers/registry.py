"""Providers by routing-file `type`: each type's builder imports only what that type needs (the
embedded engine's torch only for `type: local`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from openalice_runner.providers.base import Provider
from openalice_runner.providers.config import ProviderConfig

# An engine for the `local` providers: an openalice_runner.engine.Engine, typed `object` here so
# that the core never imports the engine.
EngineArg: TypeAlias = object | None


def _embedded(name: str, config: Any, engine: EngineArg) -> Provider:
    from openalice_runner.providers.local import EmbeddedProvider

    return EmbeddedProvider(name, config, engine=engine)


def _sglang(name: str, config: Any, engine: EngineArg) -> Provider:
    from openalice_runner.providers.pools.sglang.provider import SGLangProvider

    return SGLangProvider(name, config)


def _vllm(name: str, config: Any, engine: EngineArg) -> Provider:
    from openalice_runner.providers.pools.vllm.provider import VLLMProvider

    return VLLMProvider(name, config)


def _hosted(name: str, config: Any, engine: EngineArg) -> Provider:
    from openalice_runner.providers.hosted import HostedProvider

    return HostedProvider(name, config)


# routing-file `type` -> builder (`local`: the embedded engine, the operator's name for it)
BUILDERS: dict[str, Callable[[str, Any, EngineArg], Provider]] = {
    "local": _embedded, "sglang": _sglang, "vllm": _vllm, "hosted": _hosted,
}  # fmt: skip


def build_provider(name: str, config: ProviderConfig, engine: EngineArg = None) -> Provider:
    """Provider instance for one entry of the routing config (imports only what that type needs)."""
    builder = BUILDERS.get(config.type)
    if builder is None:
        raise ValueError(f"unknown provider type {config.type!r}")
    return builder(name, config, engine)
